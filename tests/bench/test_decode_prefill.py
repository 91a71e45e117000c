"""The CPU side of bench/decode_prefill.py (its runs need the H200): which prefill settings a run
times side by side, the flags that choose them, and the table's lookahead column."""

import attrs
import pytest

from bench.decode_prefill import BenchConfig, main, prefill_settings, tables

CHOSEN = ("flash", "mma", True, True, False)
"""A backend's own choices: flash attention, the tensor-core delta rule, accumulate and large-M on,
lookahead off."""


def test_with_no_lists_a_run_times_the_backend_s_own_choice():
    assert prefill_settings(BenchConfig(), CHOSEN) == [CHOSEN]


def test_lookahead_switches_the_flash_walk_only():
    """A review found matrix and cuda-core timed twice, once labelled lookahead on, though they have
    no walk to switch."""
    cfg = attrs.evolve(BenchConfig(), prefill_attention=("flash", "matrix"), flash_lookahead=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, True, False), ("flash", "mma", True, True, True),
                                             ("matrix", "mma", True, True, False)]
    cfg = attrs.evolve(cfg, flash_lookahead=(True,), gemm_large=(False, True))
    assert prefill_settings(cfg, CHOSEN) == [("flash", "mma", True, False, True), ("flash", "mma", True, True, True),
                                             ("matrix", "mma", True, False, True), ("matrix", "mma", True, True, True)]


@pytest.mark.parametrize("value", ["yes", "ON", "on, off"])
def test_a_bad_lookahead_setting_is_named(value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--flash-lookahead", value])
    assert stop.value.code == 2
    assert "--flash-lookahead: unknown settings" in capsys.readouterr().err


def test_the_prefill_table_has_the_lookahead_column():
    rows = [{"rows": 32768, "ttft_s": 1.12, "roof_s": 0.66, "attention": "flash", "delta": "mma", "accumulate": True,
             "gemm_large": True, "flash_lookahead": on} for on in (False, True)]
    rows.append(dict(rows[0], attention="matrix", flash_lookahead=None))
    text = tables({"presets": {"qwen3.5-9b": {"decode": [], "prefill": rows}}})
    lines = [x for x in text.splitlines() if x.startswith("| qwen3.5-9b | 32768")]
    assert [x.split(" | ")[6] for x in lines] == ["off", "on", "-"]
    assert "| lookahead |" in text
