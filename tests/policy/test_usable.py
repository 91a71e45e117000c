"""Usable rows (rule 2), the longest usable kept row (rule 5) and the warm-end rule."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.plan import fresh_cuts
from policy.usable import (
    BackendFacts,
    KeptRow,
    cut_fingerprint,
    snap_starts,
    is_usable,
    resume_row,
    warm_end_row,
)

DEFAULT = PolicyConfig()
NO_STARTS = PolicyConfig(request_starts=False)
EXACT_STARTS = PolicyConfig(snap_starts=False)
NO_GRID = BackendFacts()
GRID_64 = BackendFacts(invariant_rows=64)
STARTS = (0, 1000, 5000)  # a 9000-row prompt: fresh cuts 1000, 4096, 5000, 8192


@pytest.mark.parametrize(
    ("row", "cfg", "facts", "has_logits", "usable"),
    [
        (4096, DEFAULT, NO_GRID, False, True),
        (8192, DEFAULT, NO_GRID, False, True),
        (1000, DEFAULT, NO_GRID, False, True),
        (5000, DEFAULT, NO_GRID, False, True),
        (1, DEFAULT, NO_GRID, False, False),
        (1001, DEFAULT, NO_GRID, False, False),
        (4095, DEFAULT, NO_GRID, False, False),
        (4097, DEFAULT, NO_GRID, False, False),
        (1024, DEFAULT, NO_GRID, False, False),
        (0, DEFAULT, NO_GRID, False, False),
        (9000, DEFAULT, NO_GRID, False, False),
        (9000, DEFAULT, NO_GRID, True, True),
        (9001, DEFAULT, NO_GRID, True, False),
        (-64, DEFAULT, GRID_64, False, False),
        (1000, NO_STARTS, NO_GRID, False, False),
        (4096, NO_STARTS, NO_GRID, False, True),
        (1024, DEFAULT, GRID_64, False, True),
        (64, DEFAULT, GRID_64, False, True),
        (8960, DEFAULT, GRID_64, False, True),
        (1000, DEFAULT, GRID_64, False, True),
        (1000, NO_STARTS, GRID_64, False, False),
        (1030, DEFAULT, GRID_64, False, False),
        (0, DEFAULT, GRID_64, False, False),
    ],
    ids=[
        "mark-4096", "mark-8192", "start-1000", "start-5000", "row-1", "start+1", "mark-1",
        "mark+1", "off-grid-1024", "row-0", "end-no-logits", "end-with-logits", "past-end",
        "negative", "start-but-starts-off", "mark-starts-off", "grid-1024", "grid-64",
        "grid-8960", "start-with-grid", "start-off-grid-starts-off", "off-grid-1030", "grid-row-0",
    ],
)
def test_is_usable(row, cfg, facts, has_logits, usable):
    assert is_usable(row, 9000, STARTS, cfg, facts, has_logits=has_logits) is usable


def test_is_usable_max_chunk_split_counts_as_a_cut():
    cfg = PolicyConfig(max_chunk_rows=1000)
    assert is_usable(3000, 9000, (0,), cfg, NO_GRID)
    assert not is_usable(3500, 9000, (0,), cfg, NO_GRID)


def test_cut_fingerprint():
    cuts = (1000, 4096, 5000, 8192)
    assert cut_fingerprint(cuts, 5000, NO_GRID) == (1000, 4096)
    assert cut_fingerprint(cuts, 5001, NO_GRID) == (1000, 4096, 5000)
    assert cut_fingerprint(cuts, 1000, NO_GRID) == ()
    assert cut_fingerprint(cuts, 9000, GRID_64) == (1000, 5000)


def _kept(row, cfg=DEFAULT, facts=NO_GRID, has_logits=False):
    return KeptRow(row, cut_fingerprint(fresh_cuts(9000, STARTS, cfg), row, facts), has_logits)


def test_resume_row_picks_the_longest_usable():
    kept = [_kept(1000), _kept(8192), _kept(4096), _kept(5000)]
    assert resume_row(9000, STARTS, DEFAULT, NO_GRID, kept) == 8192


def test_resume_row_skips_unusable_and_mismatched_fingerprints():
    kept = [
        _kept(4096),
        KeptRow(8192, (4096, 5000)),  # a pass that never cut at 1000: other bits
        KeptRow(8500, _kept(8500).fingerprint),  # not a cut
        KeptRow(9000, _kept(9000).fingerprint, has_logits=False),  # end without logits
    ]
    assert resume_row(9000, STARTS, DEFAULT, NO_GRID, kept) == 4096


def test_resume_row_full_hit_with_logits():
    kept = [_kept(8192), _kept(9000, has_logits=True)]
    assert resume_row(9000, STARTS, DEFAULT, NO_GRID, kept) == 9000


def test_resume_row_on_invariant_grid():
    kept = [_kept(5000, facts=GRID_64), _kept(8960, facts=GRID_64)]
    assert resume_row(9000, STARTS, DEFAULT, GRID_64, kept) == 8960
    assert resume_row(9000, STARTS, DEFAULT, NO_GRID, [KeptRow(8960, (1000, 4096, 5000, 8192))]) == 0


def test_resume_row_nothing_kept():
    assert resume_row(9000, STARTS, DEFAULT, NO_GRID, []) == 0


@pytest.mark.parametrize(
    ("end", "next_starts", "cfg", "facts", "expected"),
    [
        (4096, (0,), DEFAULT, NO_GRID, 4096),
        (8192, (0,), NO_STARTS, NO_GRID, 8192),
        (3000, (0, 3000), DEFAULT, NO_GRID, 3000),
        (3000, (0, 3000), DEFAULT, GRID_64, 2944),
        (3000, (0, 3000), EXACT_STARTS, GRID_64, 3000),
        (3000, (0, 3000), NO_STARTS, NO_GRID, None),
        (3000, (0, 3000), NO_STARTS, GRID_64, 2944),
        (3000, (0,), DEFAULT, NO_GRID, None),
        (3000, (0,), DEFAULT, GRID_64, 2944),
        (4097, (0,), DEFAULT, GRID_64, 4096),
        (63, (0,), NO_STARTS, GRID_64, None),
        (65, (0,), NO_STARTS, GRID_64, 64),
        (1, (0, 1), DEFAULT, NO_GRID, 1),
        (0, (0,), DEFAULT, GRID_64, None),
    ],
    ids=[
        "mark", "mark-starts-off", "start", "start-with-grid-snaps", "start-with-grid-exact", "start-but-starts-off",
        "grid-floor", "not-a-start", "not-a-start-grid", "4097-grid", "63-below-grid",
        "65-grid", "1-row-start", "empty",
    ],
)
def test_warm_end_row(end, next_starts, cfg, facts, expected):
    assert warm_end_row(end, next_starts, cfg, facts) == expected


@pytest.mark.parametrize("bad", [0, -64, True, 64.0], ids=["zero", "negative", "bool", "float"])
def test_backend_facts_validation_names_the_field(bad):
    with pytest.raises(ValueError, match="invariant_rows"):
        BackendFacts(invariant_rows=bad)


@pytest.mark.parametrize(
    ("starts", "cfg", "facts", "expected"),
    [
        ((0, 18, 2014, 2028), DEFAULT, GRID_64, (1984,)),
        ((0, 4096, 4110), DEFAULT, GRID_64, (4096,)),
        ((0, 64, 130, 127), DEFAULT, GRID_64, (64, 128)),
        ((0, 18, 2014, 2028), EXACT_STARTS, GRID_64, (0, 18, 2014, 2028)),
        ((2028, 18, 0, 18), DEFAULT, NO_GRID, (0, 18, 2028)),
        ((0, 18, 2014), NO_STARTS, GRID_64, (0, 18, 2014)),
    ],
    ids=["snapped-off-grid", "snapped-on-grid", "merged", "exact", "no-grid", "starts-off"],
)
def test_snap_starts(starts, cfg, facts, expected):
    assert snap_starts(starts, cfg, facts) == expected


def test_a_snapped_continuation_is_one_chunk():
    """The warm-turns continuation (bench/warm_turns.py, on-grid): resumed at 4096, the new user
    message starts at 4096 and the generation prompt at 4110. Exact starts cut it in two
    host-bound chunks; snapped to the 64-row grid it is one, and the cold pass keeps nothing
    before its end (both snapped starts sit at the resume row)."""
    from policy.keep import PassKind, keep_rows
    from policy.plan import Chunk, plan_chunks

    starts = (0, 18, 4096, 4110)
    exact = plan_chunks(4117, snap_starts(starts, EXACT_STARTS, GRID_64), 4096, EXACT_STARTS)
    assert exact == (Chunk(4096, 4110), Chunk(4110, 4117, True))
    snapped = snap_starts(starts, DEFAULT, GRID_64)
    assert plan_chunks(4117, snapped, 4096, DEFAULT) == (Chunk(4096, 4117, True),)
    assert [k.row for k in keep_rows(PassKind.COLD, 4117, snapped, 4096, DEFAULT, GRID_64)] == [4117]
