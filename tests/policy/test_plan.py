"""Chunk plans (rule 1) at awkward sizes, written out by hand."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.plan import Chunk, check_starts, fresh_cuts, plan_chunks

DEFAULT = PolicyConfig()
NO_STARTS = PolicyConfig(request_starts=False)
SPLIT_1000 = PolicyConfig(max_chunk_rows=1000)
GRID_64 = PolicyConfig(grid_rows=64, max_chunk_rows=64)

CASES = [
    # id, cfg, rows, starts, resume, expected (start, end) chunks
    ("1-row", DEFAULT, 1, (0,), 0, [(0, 1)]),
    ("63-rows", DEFAULT, 63, (0,), 0, [(0, 63)]),
    ("65-rows-start-20", DEFAULT, 65, (0, 20), 0, [(0, 20), (20, 65)]),
    ("4095-rows", DEFAULT, 4095, (0,), 0, [(0, 4095)]),
    ("4096-rows-mark-is-the-end", DEFAULT, 4096, (0,), 0, [(0, 4096)]),
    ("4097-rows", DEFAULT, 4097, (0,), 0, [(0, 4096), (4096, 4097)]),
    ("4097-rows-start-4096", DEFAULT, 4097, (0, 4096), 0, [(0, 4096), (4096, 4097)]),
    (
        "9000-rows-starts",
        DEFAULT, 9000, (0, 1000, 5000, 8999), 0,
        [(0, 1000), (1000, 4096), (4096, 5000), (5000, 8192), (8192, 8999), (8999, 9000)],
    ),
    (
        "9000-rows-resume-at-mark",
        DEFAULT, 9000, (0, 1000, 5000, 8999), 4096,
        [(4096, 5000), (5000, 8192), (8192, 8999), (8999, 9000)],
    ),
    (
        "9000-rows-resume-at-start",
        DEFAULT, 9000, (0, 1000, 5000, 8999), 1000,
        [(1000, 4096), (4096, 5000), (5000, 8192), (8192, 8999), (8999, 9000)],
    ),
    ("9000-rows-resume-at-last-start", DEFAULT, 9000, (0, 1000, 5000, 8999), 8999, [(8999, 9000)]),
    (
        "9000-rows-starts-off",
        NO_STARTS, 9000, (0, 1000, 5000, 8999), 0,
        [(0, 4096), (4096, 8192), (8192, 9000)],
    ),
    (
        "9000-rows-split-1000",
        SPLIT_1000, 9000, (0, 1500), 0,
        [(0, 1000), (1000, 1500), (1500, 2000), (2000, 3000), (3000, 4000), (4000, 4096),
         (4096, 5000), (5000, 6000), (6000, 7000), (7000, 8000), (8000, 8192), (8192, 9000)],
    ),
    (
        "9000-rows-split-1000-resume-off-split",
        SPLIT_1000, 9000, (0, 1500), 2500,
        [(2500, 3000), (3000, 4000), (4000, 4096), (4096, 5000), (5000, 6000), (6000, 7000),
         (7000, 8000), (8000, 8192), (8192, 9000)],
    ),
    (
        "200-rows-grid-64-starts-63-65",
        GRID_64, 200, (0, 63, 65), 0,
        [(0, 63), (63, 64), (64, 65), (65, 128), (128, 192), (192, 200)],
    ),
]


@pytest.mark.parametrize(
    ("cfg", "rows", "starts", "resume", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_plan_examples(cfg, rows, starts, resume, expected):
    chunks = plan_chunks(rows, starts, resume, cfg)
    assert [(c.start, c.end) for c in chunks] == expected
    assert [c.reads_logits for c in chunks] == [False] * (len(expected) - 1) + [True]
    fresh = fresh_cuts(rows, starts, cfg)
    assert [c.start for c in chunks] == [resume, *(c for c in fresh if c > resume)]


def test_fresh_cuts_examples():
    assert fresh_cuts(9000, (0, 1000, 5000, 8999), DEFAULT) == (1000, 4096, 5000, 8192, 8999)
    assert fresh_cuts(9000, (0, 1000), NO_STARTS) == (4096, 8192)
    assert fresh_cuts(0, (), DEFAULT) == ()
    assert fresh_cuts(4096, (), DEFAULT) == ()
    assert fresh_cuts(8193, (), DEFAULT) == (4096, 8192)


def test_split_does_not_depend_on_where_the_span_begins():
    # A span [1500, 4096) splits at absolute multiples of 1000, not 1500 + 1000.
    assert fresh_cuts(4096, (0, 1500), SPLIT_1000) == (1000, 1500, 2000, 3000, 4000)


def test_resume_at_end_plans_nothing():
    assert plan_chunks(4097, (0,), 4097, DEFAULT) == ()


def test_warm_plans_read_no_logits():
    chunks = plan_chunks(9000, (0, 1000), 0, DEFAULT, reads_logits=False)
    assert len(chunks) == 4 and not any(c.reads_logits for c in chunks)


@pytest.mark.parametrize("resume", [-1, 4098], ids=["negative", "past-end"])
def test_resume_outside_prompt_is_an_error(resume):
    with pytest.raises(ValueError, match=f"resume {resume} outside"):
        plan_chunks(4097, (0,), resume, DEFAULT)


@pytest.mark.parametrize("start", [-1, 4097, 5000], ids=["negative", "at-end", "past-end"])
def test_bad_start_is_an_error(start):
    with pytest.raises(ValueError, match=f"request start {start} outside"):
        fresh_cuts(4097, (0, start), DEFAULT)


def test_check_starts_sorts_and_dedups():
    assert check_starts(100, [50, 0, 50, 7]) == (0, 7, 50)


def test_negative_rows_is_an_error():
    with pytest.raises(ValueError, match="prompt_rows must be >= 0"):
        fresh_cuts(-1, (), DEFAULT)


@pytest.mark.parametrize(("start", "end"), [(0, 0), (5, 4), (-1, 3)], ids=["empty", "reversed", "negative"])
def test_chunk_validation(start, end):
    with pytest.raises(ValueError, match="chunk needs 0 <= start < end"):
        Chunk(start, end)
    assert Chunk(3, 10).rows == 7
