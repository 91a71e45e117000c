"""Rule 1 properties: plan consistency from every usable resume row, and how chunks tile.

Each property is a `check_*` function over the plan under test; it runs against
`plan_chunks` (must hold) and against a planted wrong plan (Hypothesis must catch it).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import (
    Case,
    assert_caught,
    cases,
    cases_with_resume,
    oracle_fresh_cuts,
    usable_resume_rows,
)

from policy.plan import Chunk, fresh_cuts, plan_chunks


def plan_cuts(plan_fn, case: Case, resume: int, **kwargs) -> list[int]:
    """The cuts of a plan: the start of every chunk (the first is `resume`)."""
    return [c.start for c in plan_fn(case.rows, case.starts, resume, case.cfg, **kwargs)]


def check_plan_consistency(plan_fn, example: tuple[Case, int]) -> None:
    """cuts(plan(resume=R)) == [R] + the cuts of plan(resume=0) after R, for usable R < L."""
    case, resume = example
    fresh = plan_cuts(plan_fn, case, 0)[1:]
    assert plan_cuts(plan_fn, case, resume) == [resume, *(c for c in fresh if c > resume)], (
        f"resume {resume}: {plan_cuts(plan_fn, case, resume)} vs fresh {fresh}"
    )


def check_plan_tiles(plan_fn, example: tuple[Case, int, bool]) -> None:
    """Chunks tile [R, L) with no gap or overlap, none longer than max_chunk_rows, every
    hard cut after R (mark; request start when on) is a cut, and only the last chunk of a
    cold plan reads logits."""
    (case, resume), reads_logits = example[:2], example[2]
    cfg = case.cfg
    chunks = plan_fn(case.rows, case.starts, resume, cfg, reads_logits=reads_logits)
    if resume == case.rows:
        assert chunks == ()
        return
    assert chunks[0].start == resume and chunks[-1].end == case.rows
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:])), chunks
    assert all(0 < c.rows <= cfg.max_chunk_rows for c in chunks), chunks
    cuts = {c.start for c in chunks}
    hard = set(range(cfg.grid_rows, case.rows, cfg.grid_rows))
    if cfg.request_starts:
        hard |= {s for s in case.starts if s > 0}
    missing = {h for h in hard if h > resume} - cuts
    assert not missing, f"hard cuts {sorted(missing)} missing from {sorted(cuts)}"
    assert [c.reads_logits for c in chunks] == [False] * (len(chunks) - 1) + [reads_logits]


def check_fresh_cuts(cuts_fn, case: Case) -> None:
    """fresh_cuts equals the rule restated (hard cuts, then absolute splits of long spans)."""
    assert list(cuts_fn(case.rows, case.starts, case.cfg)) == oracle_fresh_cuts(
        case.rows, case.starts, case.cfg
    )


# --- planted wrong plans ---------------------------------------------------------------
def plan_forgets_starts_after_resume(rows, starts, resume, cfg, *, reads_logits=True):
    """Wrong: a resumed pass plans as if the prompt had no request starts."""
    return plan_chunks(rows, () if resume else starts, resume, cfg, reads_logits=reads_logits)


def plan_splits_from_resume(rows, starts, resume, cfg, *, reads_logits=True):
    """Wrong: long spans are split every max_chunk_rows from where the span (or pass) began."""
    return _split_relative(_hard_only(rows, starts, resume, cfg), cfg, reads_logits)


def _hard_only(rows, starts, resume, cfg):
    hard = set(range(cfg.grid_rows, rows, cfg.grid_rows))
    if cfg.request_starts:
        hard |= {s for s in starts if s > 0}
    edges = [resume, *sorted(h for h in hard if h > resume), rows]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def _split_relative(spans, cfg, reads_logits):
    out = []
    for a, b in spans:
        while b - a > cfg.max_chunk_rows:
            out.append((a, a + cfg.max_chunk_rows))
            a += cfg.max_chunk_rows
        out.append((a, b))
    return tuple(Chunk(a, b, reads_logits and i == len(out) - 1) for i, (a, b) in enumerate(out))


def plan_ignores_max_chunk(rows, starts, resume, cfg, *, reads_logits=True):
    """Wrong: only hard cuts, so a long span becomes one long chunk."""
    spans = _hard_only(rows, starts, resume, cfg)
    return tuple(Chunk(a, b, reads_logits and i == len(spans) - 1) for i, (a, b) in enumerate(spans))


def cuts_split_every_span(rows, starts, cfg):
    """Wrong: also splits spans no longer than max_chunk_rows at multiples of it."""
    step = cfg.max_chunk_rows
    return tuple(sorted(set(fresh_cuts(rows, starts, cfg)) | set(range(step, rows, step))))


# --- properties ----------------------------------------------------------------------------
@given(cases_with_resume())
def test_plan_consistency(example):
    check_plan_consistency(plan_chunks, example)


@given(cases_with_resume(real=True))
def test_plan_consistency_at_4096_grid(example):
    check_plan_consistency(plan_chunks, example)


def any_resume() -> st.SearchStrategy[tuple[Case, int]]:
    """A case and any row in [0, L] to resume from (tiling holds from every row)."""
    return cases().flatmap(lambda c: st.tuples(st.just(c), st.integers(0, c.rows)))


def with_logits_flag(strategy) -> st.SearchStrategy[tuple[Case, int, bool]]:
    return st.tuples(strategy, st.booleans()).map(lambda t: (*t[0], t[1]))


@given(with_logits_flag(any_resume()))
def test_plan_tiles_from_any_resume(example):
    check_plan_tiles(plan_chunks, example)


@given(with_logits_flag(cases_with_resume(real=True)))
def test_plan_tiles_at_4096_grid(example):
    check_plan_tiles(plan_chunks, example)


@given(cases())
def test_fresh_cuts_match_the_rule(case):
    check_fresh_cuts(fresh_cuts, case)


@given(cases_with_resume())
def test_fresh_plan_resume_rows_are_all_usable_resumes(example):
    # Every chunk end of a plan from a usable row is itself a usable row (or the end).
    case, resume = example
    usable = set(usable_resume_rows(case)) | {case.rows}
    assert {c.end for c in plan_chunks(case.rows, case.starts, resume, case.cfg)} <= usable


# --- planted bugs are caught ---------------------------------------------------------------
def test_consistency_catches_a_plan_that_forgets_starts_after_resume():
    assert_caught(cases_with_resume(), lambda ex: check_plan_consistency(plan_forgets_starts_after_resume, ex))


def test_consistency_catches_splits_relative_to_the_resume_row():
    assert_caught(cases_with_resume(), lambda ex: check_plan_consistency(plan_splits_from_resume, ex))


def test_tiling_catches_a_plan_that_ignores_max_chunk_rows():
    assert_caught(with_logits_flag(any_resume()), lambda ex: check_plan_tiles(plan_ignores_max_chunk, ex))


def test_tiling_catches_a_plan_that_forgets_starts_after_resume():
    assert_caught(
        with_logits_flag(any_resume()), lambda ex: check_plan_tiles(plan_forgets_starts_after_resume, ex)
    )


def test_fresh_cuts_property_catches_splitting_short_spans():
    assert_caught(cases(), lambda case: check_fresh_cuts(cuts_split_every_span, case))
