"""The CPU side of bench/decode_prefill.py (its runs need the H200): which prefill settings a run
times side by side, the flags that choose them, the table's lookahead column, and the last-row logits
digest that shows two builds kept those bits."""

import hashlib

import attrs
import numpy as np
import pytest

from bench.decode_prefill import (BenchConfig, logits_digest, main, prefill_flops, prefill_ours, prefill_settings,
                                  prompt_chunks, served_tail_from, tables, tail_differs)
from executor.presets import preset
from policy.plan import Chunk

CHOSEN = ("flash", "mma", True, True, False, True, True, None)
"""A backend's own choices: flash attention, the tensor-core delta rule, accumulate and large-M on,
lookahead off, bf16 products on; the bench's own: the server's tail, one chunk."""


def test_with_no_lists_a_run_times_the_backend_s_own_choice():
    assert prefill_settings(BenchConfig(), CHOSEN) == [CHOSEN]


def test_lookahead_switches_the_flash_walk_only():
    """A review found matrix and cuda-core timed twice, once labelled lookahead on, though they have
    no walk to switch."""
    cfg = attrs.evolve(BenchConfig(), prefill_attention=("flash", "matrix"), flash_lookahead=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, True, False, True, True, None),
                                             ("flash", "mma", True, True, True, True, True, None),
                                             ("matrix", "mma", True, True, False, True, True, None)]
    cfg = attrs.evolve(cfg, flash_lookahead=(True,), gemm_large=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, False, True, True, True, None),
                                             ("flash", "mma", True, True, True, True, True, None),
                                             ("matrix", "mma", True, False, True, True, True, None),
                                             ("matrix", "mma", True, True, True, True, True, None)]


def test_bf16_products_are_timed_side_by_side_on_every_path():
    cfg = attrs.evolve(BenchConfig(), prefill_attention=("flash", "matrix"), bf16_products=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, True, False, False, True, None),
                                             ("flash", "mma", True, True, False, True, True, None),
                                             ("matrix", "mma", True, True, False, False, True, None),
                                             ("matrix", "mma", True, True, False, True, True, None)]


@pytest.mark.parametrize("flag", ["--flash-lookahead", "--bf16-products", "--tail"])
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
    assert "| lookahead | bf16 products | tail | plan |" in text


class _FakeBackend:
    """prefill returns the logits of `outputs` in turn (a stand-in for the GPU backend)."""

    def __init__(self, outputs):
        self.config = attrs.evolve(preset("qwen3.5-9b"), vocab_size=50)
        self.outputs = list(outputs)
        self.calls = []

    def new_state(self):
        return object()

    def release(self, state):
        pass

    def prefill(self, state, ids, span, want_logits=True, tail_from=None):
        self.calls.append((span, want_logits, tail_from))
        return self.outputs.pop(0) if want_logits else None


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


def test_the_server_s_tail_is_the_policy_s_rule_on_the_model():
    c = preset("qwen3.5-9b")
    assert served_tail_from(c, Chunk(0, 32768, True)) == 32768 - 128
    assert served_tail_from(c, Chunk(4096, 8192, False)) == 8192  # logits unread: the empty tail
    assert served_tail_from(c, Chunk(0, 128, True)) is None  # no more rows than the tail keeps
    assert served_tail_from(attrs.evolve(c, layer_types=(*c.layer_types[:-1], "linear_attention")),
                            Chunk(0, 32768, True)) is None


def test_the_plans_are_one_chunk_or_the_policy_s_cuts():
    assert prompt_chunks(32768, None) == (Chunk(0, 32768, True),)
    chunks = prompt_chunks(10000, 4096)
    assert [(x.start, x.end, x.reads_logits) for x in chunks] == [(0, 4096, False), (4096, 8192, False),
                                                                  (8192, 10000, True)]


def test_a_tail_takes_the_skipped_rows_work_off_the_roofline():
    c = preset("qwen3.5-9b")
    rows, t = 32768, 128
    h, qd, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size
    # q_proj (q and gate), o_proj, gate|up and down skip the rows before the tail; kv_proj does not
    skipped_gemm = 2.0 * (rows - t) * (2 * qd * h + h * qd + 2 * inter * h + h * inter)
    full_pairs, tail_pairs = rows * rows / 2, t * (rows - t / 2)
    attention = 4.0 * (full_pairs - tail_pairs) * c.num_attention_heads * c.head_dim
    assert prefill_flops(c, rows) - prefill_flops(c, rows, t) == pytest.approx(skipped_gemm + attention, rel=1e-12)
    assert prefill_flops(c, rows, rows) == prefill_flops(c, rows)  # every row ran the last layer
    # the 9B at 32K by hand: 24 linear layers (in_proj 12352 x 4096, out_proj 4096 x 4096), 8 full (q 8192, kv 2048,
    # o 4096 x 4096), 32 MLPs (gate|up 24576 x 4096, down 4096 x 12288), causal attention 16 heads of 256, the LM head
    mlp = 24576 * 4096 + 4096 * 12288
    params = 24 * (12352 * 4096 + 4096 * 4096 + mlp) + 8 * ((8192 + 2048) * 4096 + 4096 * 4096 + mlp)
    by_hand = 2.0 * rows * params + 8 * 4.0 * (rows * rows / 2) * 16 * 256 + 2.0 * 4096 * 248320
    assert prefill_flops(c, rows) == pytest.approx(by_hand, rel=1e-12)


def test_a_prefill_passes_the_server_s_tail_to_each_chunk():
    cfg = attrs.evolve(BenchConfig(), ttft_repeats=1)
    same = np.linspace(-1, 1, 50, dtype=np.float32)
    fake = _FakeBackend([same])
    out = prefill_ours(fake, 10000, cfg, profile=False, tail=True, chunk_rows=4096)
    assert fake.calls == [((0, 4096), False, 4096), ((4096, 8192), False, 8192), ((8192, 10000), True, 10000 - 128)]
    assert (out["chunks"], out["tail_rows"], out["last_layer_rows"]) == (3, 128, 128)
    fake = _FakeBackend([same])
    out = prefill_ours(fake, 10000, cfg, profile=False, tail=False)
    assert fake.calls == [((0, 10000), True, 0)]  # the whole last layer: tail_from = the chunk's start
    assert (out["chunks"], out["tail_rows"], out["last_layer_rows"]) == (1, None, 10000)
    fake = _FakeBackend([same])
    out = prefill_ours(fake, 10000, cfg, profile=False, tail=False, chunk_rows=4096)
    assert fake.calls == [((0, 4096), False, 0), ((4096, 8192), False, 4096), ((8192, 10000), True, 8192)]
    assert out["last_layer_rows"] == 10000


def test_a_last_chunk_too_short_for_a_tail_still_counts_what_ran():
    """A review found the roofline counting the whole last layer here: the chunks before the last skip its
    q/o/MLP (tail_from = their end), and the 64-row last chunk runs them over its own rows only."""
    cfg = attrs.evolve(BenchConfig(), ttft_repeats=1)
    fake = _FakeBackend([np.zeros(50, np.float32)])
    out = prefill_ours(fake, 8256, cfg, profile=False, tail=True, chunk_rows=4096)
    assert fake.calls == [((0, 4096), False, 4096), ((4096, 8192), False, 8192), ((8192, 8256), True, None)]
    assert (out["tail_rows"], out["last_layer_rows"]) == (64, 64)
    c = preset("qwen3.5-9b")
    assert prefill_flops(c, 8256, 64) < prefill_flops(c, 8256, 128) < prefill_flops(c, 8256)


def test_tail_on_and_off_must_give_the_same_logits():
    base = {"rows": 32768, "attention": "flash", "delta": "mma", "accumulate": True, "gemm_large": True,
            "flash_lookahead": False, "bf16_products": True}
    rows = [dict(base, tail=True, logits_sha256="aa"), dict(base, tail=False, logits_sha256="aa"),
            dict(base, rows=8192, tail=True, logits_sha256="bb"), dict(base, rows=8192, tail=False, logits_sha256="cc")]
    assert tail_differs(rows) == ["rows 8192: bb, cc"]
    assert tail_differs(rows[:2]) == []
    # another bf16-products setting is another bit definition of nothing: still compared apart
    assert tail_differs([rows[0], dict(rows[1], bf16_products=False, logits_sha256="dd")]) == []


def test_the_prefill_table_names_the_tail_and_the_plan():
    row = {"rows": 32768, "ttft_s": 0.99, "roof_s": 0.6, "attention": "flash", "delta": "mma", "accumulate": True,
           "gemm_large": True, "flash_lookahead": False, "bf16_products": True}
    rows = [dict(row, tail=True, tail_rows=128, chunks=1, chunk_rows=None),
            dict(row, tail=False, tail_rows=None, chunks=1, chunk_rows=None),
            dict(row, tail=True, tail_rows=128, chunks=8, chunk_rows=4096)]
    text = tables({"presets": {"qwen3.5-9b": {"decode": [], "prefill": rows}}})
    lines = [x for x in text.splitlines() if x.startswith("| qwen3.5-9b | 32768")]
    assert [x.split(" | ")[8:10] for x in lines] == [["on (128 rows)", "1 chunk"], ["off", "1 chunk"],
                                                    ["on (128 rows)", "8 chunks of 4096"]]


@pytest.mark.parametrize("value", ["4k", "-1", "4096,x"])
def test_a_bad_chunk_rows_is_named(value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--chunk-rows", value])
    assert stop.value.code == 2
    assert "--chunk-rows:" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1000", "4096,100"])
def test_chunk_rows_off_the_invariant_grid_are_refused(value, capsys):
    """Cuts off the 64-row grid may change bits, and the run compares plans' digests: refused up front."""
    with pytest.raises(SystemExit) as stop:
        main(["--chunk-rows", value])
    assert stop.value.code == 2
    assert "multiples of 64" in capsys.readouterr().err
