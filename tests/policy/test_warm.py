"""Warm-pass decisions (rules 6 and 7): quiet, run or cancel, yield, adopt, finish reason."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.keep import KeepRow
from policy.plan import fresh_cuts
from policy.prefix import Prompt
from policy.usable import BackendFacts, cut_fingerprint
from policy.warm import (
    WarmVerdict,
    can_adopt,
    decide_warm,
    finish_reason,
    is_quiet,
    should_yield,
    warm_start_s,
)

RUN, CANCEL = WarmVerdict.RUN, WarmVerdict.CANCEL
DEFAULT = PolicyConfig()
NO_STARTS = PolicyConfig(request_starts=False)
NO_GRID = BackendFacts()
GRID_64 = BackendFacts(invariant_rows=64)
WARM_STARTS = (0, 500, 1200, 2000)  # history; the next turn's new message starts at 3000


def test_quiet_waits_warm_quiet_ms():
    assert warm_start_s(10.0, DEFAULT) == pytest.approx(10.15)
    assert not is_quiet(10.149, 10.0, DEFAULT)
    assert is_quiet(10.15, 10.0, DEFAULT)
    assert is_quiet(99.0, 10.0, DEFAULT)
    assert not is_quiet(99.0, None, DEFAULT)  # foreground work is running
    assert is_quiet(10.0, 10.0, PolicyConfig(warm_quiet_ms=0.0))


def test_warm_runs_to_its_last_keep():
    d = decide_warm(3000, WARM_STARTS, 0, DEFAULT, NO_GRID, already_kept=())
    assert (d.verdict, d.end_row, d.reason) == (RUN, 3000, "new_keep")
    assert d.keeps == (KeepRow(500), KeepRow(2000), KeepRow(3000))


def test_warm_with_something_new_runs():
    d = decide_warm(3000, WARM_STARTS, 0, DEFAULT, NO_GRID, already_kept=(500, 2000))
    assert (d.verdict, d.end_row) == (RUN, 3000)


def test_warm_is_cancelled_when_nothing_new():
    d = decide_warm(3000, WARM_STARTS, 0, DEFAULT, NO_GRID, already_kept=(500, 2000, 3000))
    assert (d.verdict, d.reason) == (CANCEL, "already_kept")


def test_warm_is_cancelled_when_nothing_would_be_usable():
    # Starts off and no invariant grid: under 4096 rows nothing at the end is usable.
    d = decide_warm(3000, WARM_STARTS, 0, NO_STARTS, NO_GRID, already_kept=())
    assert (d.verdict, d.end_row, d.keeps, d.reason) == (CANCEL, 0, (), "nothing_usable")


def test_warm_resumed_at_its_end_is_cancelled():
    d = decide_warm(3000, WARM_STARTS, 3000, DEFAULT, NO_GRID, already_kept=())
    assert (d.verdict, d.reason) == (CANCEL, "nothing_usable")


@pytest.mark.parametrize(
    "cfg", [PolicyConfig(warm_enabled=False), PolicyConfig(prompt_cache_bytes=0)],
    ids=["warm-off", "cache-off"],
)
def test_warm_off(cfg):
    d = decide_warm(3000, WARM_STARTS, 0, cfg, NO_GRID, already_kept=())
    assert (d.verdict, d.keeps, d.reason) == (CANCEL, (), "warm_off")


def test_warm_stops_at_the_last_kept_row():
    d = decide_warm(9000, (0,), 0, NO_STARTS, NO_GRID, already_kept=())
    assert (d.verdict, d.end_row) == (RUN, 8192)
    d = decide_warm(9000, (0,), 0, NO_STARTS, GRID_64, already_kept=(4096, 8192))
    assert (d.verdict, d.end_row, d.keeps[-1]) == (RUN, 8960, KeepRow(8960))


def test_yield_to_foreground():
    assert should_yield(True) and not should_yield(False)


# Adoption: the warm pass pre-filled the first 3000 rows of the next turn's 3400-row prompt.
NEXT = Prompt.synthetic([(1, 3000), (2, 400)])
NEXT_STARTS = (*WARM_STARTS, 3000)
WARM = NEXT.prefix(3000)


def warm_fp(row, cfg=DEFAULT, facts=NO_GRID):
    """Fingerprint of a warm pass over [0, 3000) at `row`."""
    return cut_fingerprint(fresh_cuts(3000, WARM_STARTS, cfg), row, facts)


@pytest.mark.parametrize(
    ("row", "adopt"),
    [(3000, True), (2000, True), (1200, True), (500, True), (2500, False), (0, False), (3001, False)],
    ids=["end", "start-2000", "start-1200", "start-500", "mid-chunk", "nothing-done", "past-warm"],
)
def test_adopt_at_rows(row, adopt):
    fp = warm_fp(min(row, 3000))
    assert can_adopt(WARM, row, fp, NEXT, NEXT_STARTS, DEFAULT, NO_GRID) is adopt


def test_adopt_needs_the_same_tokens():
    other = Prompt.synthetic([(1, 2999), (9, 401)])
    assert not can_adopt(WARM, 3000, warm_fp(3000), other, NEXT_STARTS, DEFAULT, NO_GRID)
    assert can_adopt(WARM, 2000, warm_fp(2000), other, NEXT_STARTS, DEFAULT, NO_GRID)


def test_adopt_needs_the_same_cuts():
    # The request's fresh plan has no cut at 1200: the warm pass's bits at 3000 differ.
    starts = (0, 500, 2000, 3000)
    assert not can_adopt(WARM, 3000, warm_fp(3000), NEXT, starts, DEFAULT, NO_GRID)
    assert not can_adopt(WARM, 2000, (500, 1000), NEXT, NEXT_STARTS, DEFAULT, NO_GRID)


def test_adopt_at_request_end_needs_logits():
    # A warm pass reads no logits, so it cannot stand in for a prompt that ends where it ends.
    assert not can_adopt(WARM, 3000, warm_fp(3000), WARM, WARM_STARTS, DEFAULT, NO_GRID)


def test_adopt_on_the_invariant_grid():
    fp = warm_fp(2944, NO_STARTS, GRID_64)
    assert can_adopt(WARM, 2944, fp, NEXT, NEXT_STARTS, NO_STARTS, GRID_64)
    assert not can_adopt(WARM, 2944, fp, NEXT, NEXT_STARTS, NO_STARTS, NO_GRID)


@pytest.mark.parametrize(
    ("max_tokens", "generated", "stopped", "reason"),
    [(0, 0, False, "length"), (0, 0, True, "length"), (10, 3, True, "stop"),
     (10, 10, False, "length"), (1, 1, True, "stop")],
    ids=["prefill-only", "prefill-only-stopped", "stop", "length", "stop-at-limit"],
)
def test_finish_reason(max_tokens, generated, stopped, reason):
    assert finish_reason(max_tokens, generated, stopped) == reason
