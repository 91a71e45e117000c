"""Which rows a pass keeps (rule 3), cold and warm, written out by hand."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.keep import KeepRow, PassKind, keep_rows
from policy.usable import BackendFacts

COLD, WARM = PassKind.COLD, PassKind.WARM
DEFAULT = PolicyConfig()
NO_STARTS = PolicyConfig(request_starts=False)
NO_GRID = BackendFacts()
GRID_64 = BackendFacts(invariant_rows=64)
STARTS = (0, 1000, 5000, 8999)

CASES = [
    # id, kind, cfg, facts, rows, starts, resume, expected [(row, with_logits)]
    ("cold-9000", COLD, DEFAULT, NO_GRID, 9000, STARTS, 0,
     [(1000, False), (4096, False), (8192, False), (8999, False), (9000, True)]),
    ("cold-9000-resume-4096", COLD, DEFAULT, NO_GRID, 9000, STARTS, 4096,
     [(8192, False), (8999, False), (9000, True)]),
    ("cold-9000-resume-8999", COLD, DEFAULT, NO_GRID, 9000, STARTS, 8999, [(9000, True)]),
    ("cold-9000-starts-off", COLD, NO_STARTS, NO_GRID, 9000, STARTS, 0,
     [(4096, False), (8192, False), (9000, True)]),
    ("cold-1-row", COLD, DEFAULT, NO_GRID, 1, (0,), 0, [(1, True)]),
    ("cold-4096-rows", COLD, DEFAULT, NO_GRID, 4096, (0,), 0, [(4096, True)]),
    ("cold-4097-rows", COLD, DEFAULT, NO_GRID, 4097, (0,), 0, [(4096, False), (4097, True)]),
    ("cold-one-start", COLD, DEFAULT, NO_GRID, 65, (0, 63), 0, [(63, False), (65, True)]),
    ("warm-3000", WARM, DEFAULT, NO_GRID, 3000, (0, 500, 1200, 2000), 0,
     [(500, False), (2000, False), (3000, False)]),
    ("warm-3000-resume-500", WARM, DEFAULT, NO_GRID, 3000, (0, 500, 1200, 2000), 500,
     [(2000, False), (3000, False)]),
    ("warm-63", WARM, DEFAULT, NO_GRID, 63, (0,), 0, [(63, False)]),
    ("warm-3000-starts-off", WARM, NO_STARTS, NO_GRID, 3000, (0, 500), 0, []),
    ("warm-3000-starts-off-grid", WARM, NO_STARTS, GRID_64, 3000, (0, 500), 0, [(2944, False)]),
    ("warm-9000-starts-off-grid", WARM, NO_STARTS, GRID_64, 9000, (0,), 0,
     [(4096, False), (8192, False), (8960, False)]),
    ("warm-8192-starts-off", WARM, NO_STARTS, NO_GRID, 8192, (0,), 0, [(4096, False), (8192, False)]),
    ("warm-63-starts-off-grid", WARM, NO_STARTS, GRID_64, 63, (0,), 0, []),
]


@pytest.mark.parametrize(
    ("kind", "cfg", "facts", "rows", "starts", "resume", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_keep_rows(kind, cfg, facts, rows, starts, resume, expected):
    got = keep_rows(kind, rows, starts, resume, cfg, facts)
    assert got == tuple(KeepRow(r, logits) for r, logits in expected)


def test_cache_off_keeps_nothing():
    off = PolicyConfig(prompt_cache_bytes=0)
    assert keep_rows(COLD, 9000, STARTS, 0, off, NO_GRID) == ()
    assert keep_rows(WARM, 9000, STARTS, 0, off, GRID_64) == ()


def test_resume_at_end_keeps_nothing():
    assert keep_rows(COLD, 9000, STARTS, 9000, DEFAULT, NO_GRID) == ()


def test_warm_end_below_a_mark_is_not_kept():
    # grid_rows 100 is not a multiple of the invariant grid 64: floor(120 / 64) * 64 = 64 lies
    # inside the pass's chunk [0, 100), so no state at 64 ever exists; only the mark is kept.
    cfg = PolicyConfig(grid_rows=100, max_chunk_rows=100, request_starts=False)
    assert keep_rows(WARM, 120, (0,), 0, cfg, GRID_64) == (KeepRow(100),)
    assert keep_rows(WARM, 130, (0,), 0, cfg, GRID_64) == (KeepRow(100), KeepRow(128))


def test_bad_start_is_an_error():
    with pytest.raises(ValueError, match="request start 9000 outside"):
        keep_rows(COLD, 9000, (0, 9000), 0, DEFAULT, NO_GRID)
