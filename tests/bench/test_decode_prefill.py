"""The CPU side of bench/decode_prefill.py (its runs need the H200): which prefill settings a run
times side by side, the flags that choose them, the table's lookahead column, and the last-row logits
digest that shows two builds kept those bits."""

import hashlib

import attrs
import numpy as np
import pytest

from bench.decode_prefill import BenchConfig, logits_digest, main, prefill_ours, prefill_settings, tables

CHOSEN = ("flash", "mma", True, True, False, True)
"""A backend's own choices: flash attention, the tensor-core delta rule, accumulate and large-M on,
lookahead off, bf16 products on."""


def test_with_no_lists_a_run_times_the_backend_s_own_choice():
    assert prefill_settings(BenchConfig(), CHOSEN) == [CHOSEN]


def test_lookahead_switches_the_flash_walk_only():
    """A review found matrix and cuda-core timed twice, once labelled lookahead on, though they have
    no walk to switch."""
    cfg = attrs.evolve(BenchConfig(), prefill_attention=("flash", "matrix"), flash_lookahead=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, True, False, True),
                                             ("flash", "mma", True, True, True, True),
                                             ("matrix", "mma", True, True, False, True)]
    cfg = attrs.evolve(cfg, flash_lookahead=(True,), gemm_large=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, False, True, True),
                                             ("flash", "mma", True, True, True, True),
                                             ("matrix", "mma", True, False, True, True),
                                             ("matrix", "mma", True, True, True, True)]


def test_bf16_products_are_timed_side_by_side_on_every_path():
    cfg = attrs.evolve(BenchConfig(), prefill_attention=("flash", "matrix"), bf16_products=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, True, False, False),
                                             ("flash", "mma", True, True, False, True),
                                             ("matrix", "mma", True, True, False, False),
                                             ("matrix", "mma", True, True, False, True)]


@pytest.mark.parametrize("flag", ["--flash-lookahead", "--bf16-products"])
@pytest.mark.parametrize("value", ["yes", "ON", "on, off"])
def test_a_bad_on_off_setting_is_named(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        main([flag, value])
    assert stop.value.code == 2
    assert f"{flag}: unknown settings" in capsys.readouterr().err


def test_the_prefill_table_has_the_lookahead_column():
    rows = [{"rows": 32768, "ttft_s": 1.12, "roof_s": 0.66, "attention": "flash", "delta": "mma", "accumulate": True,
             "gemm_large": True, "flash_lookahead": on, "bf16_products": not on} for on in (False, True)]
    rows.append(dict(rows[0], attention="matrix", flash_lookahead=None))
    text = tables({"presets": {"qwen3.5-9b": {"decode": [], "prefill": rows}}})
    lines = [x for x in text.splitlines() if x.startswith("| qwen3.5-9b | 32768")]
    assert [x.split(" | ")[6] for x in lines] == ["off", "on", "-"]
    assert [x.split(" | ")[7] for x in lines] == ["on", "off", "on"]
    assert "| lookahead | bf16 products |" in text


class _FakeBackend:
    """prefill returns the logits of `outputs` in turn (a stand-in for the GPU backend)."""

    def __init__(self, outputs):
        self.config = attrs.make_class("C", {"vocab_size": attrs.field(default=50)})()
        self.outputs = list(outputs)

    def new_state(self):
        return object()

    def release(self, state):
        pass

    def prefill(self, state, ids, span):
        assert span == (0, len(ids))
        return self.outputs.pop(0)


def test_the_digest_is_the_sha256_of_the_float32_logits():
    logits = np.array([1.0, -2.5, 3.25], np.float32)
    assert logits_digest(logits) == hashlib.sha256(logits.tobytes()).hexdigest()[:16]
    assert logits_digest(logits.astype(np.float64)) == logits_digest(logits)
    flipped = logits.copy()
    flipped.view(np.uint32)[1] ^= 1  # one bit of one logit
    assert logits_digest(flipped) != logits_digest(logits)


def test_a_prefill_records_its_digest_and_stops_when_runs_differ():
    cfg = attrs.evolve(BenchConfig(), ttft_repeats=3)
    same = np.linspace(-1, 1, 50, dtype=np.float32)
    out = prefill_ours(_FakeBackend([same, same.copy(), same.copy()]), 16, cfg, profile=False)
    assert out["logits_sha256"] == logits_digest(same)
    assert len(out["ttft_runs_s"]) == 3
    other = same.copy()
    other[7] = np.nextafter(other[7], np.float32(2))
    with pytest.raises(AssertionError, match="16 rows gave 2 different last-row logits over 3 runs"):
        prefill_ours(_FakeBackend([same, other, same.copy()]), 16, cfg, profile=False)
