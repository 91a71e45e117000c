"""Rule 3 properties: the rows a cold or warm pass keeps.

Every kept row is a cut of the pass's own plan or its end, above its resume row; a cold
pass keeps every mark, its last request start and its end with logits; a warm pass keeps
only rows the next turn's fresh request can use, with the cuts that request would make.
Each `check_*` runs against `keep_rows` and against a planted wrong one.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import (
    Case,
    assert_caught,
    cases,
    oracle_fingerprint,
    oracle_fresh_cuts,
    oracle_usable,
    usable_resume_rows,
)

from policy.config import PolicyConfig
from policy.keep import KeepRow, PassKind, keep_rows
from policy.plan import check_starts, plan_chunks
from policy.usable import BackendFacts, KeptRow, cut_fingerprint, fresh_cuts, resume_row, snapping, warm_end_row


@st.composite
def keep_examples(draw, real: bool = False):
    """(case, resume, kind, next request) with resume a usable row of the case or its end."""
    case = draw(cases(real=real))
    if draw(st.integers(0, 9)) == 0:
        case = Case(case.rows, case.starts, case.cfg.with_changes(prompt_cache_bytes=0), case.facts)
    resume = draw(st.sampled_from([*usable_resume_rows(case), case.rows]))
    kind = draw(st.sampled_from(PassKind))
    grid = case.cfg.grid_rows
    next_rows = draw(st.integers(case.rows + 1, case.rows + 3 * grid))
    later = draw(st.lists(st.integers(case.rows + 1, next_rows - 1), max_size=3)) if next_rows > case.rows + 1 else []
    starts = (*case.starts, case.rows, *later) if case.cfg.request_starts else case.starts
    return case, resume, kind, Case(next_rows, tuple(sorted(set(starts))), case.cfg, case.facts)


def _misaligned(cfg: PolicyConfig, facts: BackendFacts) -> bool:
    """max_chunk_rows off the invariant grid, with the warm end at floor(E/g)*g (starts off,
    or snapped to the grid): that pass cannot know the splits the longer next request makes
    in its last span (a span over max_chunk_rows is split, one that fits is not), so its end
    may be unusable; `resume_row`'s fingerprint check refuses it then."""
    g = facts.invariant_rows
    floor_end = not cfg.request_starts or snapping(cfg, facts)
    return floor_end and g is not None and cfg.max_chunk_rows % g != 0


def check_keep_rows(keep_fn, example) -> None:
    case, resume, kind, request = example
    cfg, facts, L = case.cfg, case.facts, case.rows
    keeps = keep_fn(kind, L, case.starts, resume, cfg, facts)
    rows = [k.row for k in keeps]
    if not cfg.cache_enabled or resume >= L:
        assert keeps == ()
        return
    assert rows == sorted(set(rows)), rows
    assert all(resume < r <= L for r in rows), (resume, rows)
    inner = [s for s in case.starts if s > 0] if cfg.request_starts else []
    if kind is PassKind.COLD:
        chunks = plan_chunks(L, case.starts, resume, cfg)
        assert set(rows) <= {c.end for c in chunks}, f"kept {rows} off the plan {chunks}"
        assert keeps[-1] == KeepRow(L, True) and not any(k.with_logits for k in keeps[:-1])
        end = L
    else:
        assert not any(k.with_logits for k in keeps)
        if not keeps:
            assert not [m for m in range(cfg.grid_rows, L, cfg.grid_rows) if m > resume]
            assert (warm_end_row(L, (*case.starts, L), cfg, facts) or 0) <= resume
            return
        end = rows[-1]
        starts = tuple(s for s in case.starts if s < end)
        chunks = plan_chunks(end, starts, resume, cfg, reads_logits=False)
        assert set(rows) <= {c.end for c in chunks}, f"kept {rows} off the plan {chunks}"
        fresh = oracle_fresh_cuts(L, case.starts, cfg)
        cuts = [c for c in fresh if c < resume] + [c.start for c in chunks if c.start > 0]
        next_cuts = oracle_fresh_cuts(request.rows, request.starts, cfg)
        for r in rows:
            assert oracle_usable(request, r), f"warm keeps {r}, unusable by {request}"
            if not _misaligned(cfg, facts):
                assert oracle_fingerprint(cuts, r, facts) == oracle_fingerprint(next_cuts, r, facts), r
    marks = [m for m in range(cfg.grid_rows, end + 1, cfg.grid_rows) if resume < m < L]
    assert set(marks) <= set(rows), f"marks {marks} not all kept in {rows}"
    for s in inner[-1:] + inner[:1]:  # the newest message start and the system cut
        if resume < s < end:
            assert s in rows, f"start {s} not kept in {rows}"


# --- planted wrong implementations -----------------------------------------------------------
def keep_forgets_last_start(kind, rows, starts, resume, cfg, facts):
    """Wrong: a cold pass keeps no state at its newest message start."""
    got = keep_rows(kind, rows, starts, resume, cfg, facts)
    inner = [s for s in check_starts(rows, starts) if s > 0]
    if kind is PassKind.COLD and inner and cfg.request_starts:
        return tuple(k for k in got if k.row != inner[-1] or k.row % cfg.grid_rows == 0)
    return got


def keep_warm_end_always(kind, rows, starts, resume, cfg, facts):
    """Wrong: a warm pass keeps its end whatever its length."""
    got = keep_rows(kind, rows, starts, resume, cfg, facts)
    if kind is PassKind.WARM and cfg.cache_enabled and rows > resume:
        return tuple(sorted({*got, KeepRow(rows)}, key=lambda k: k.row))
    return got


def keep_includes_resume(kind, rows, starts, resume, cfg, facts):
    """Wrong: keeps again the row the pass resumed from."""
    got = keep_rows(kind, rows, starts, resume, cfg, facts)
    if got and resume > 0:
        return (KeepRow(resume), *got)
    return got


def keep_warm_end_below_mark(kind, rows, starts, resume, cfg, facts):
    """Wrong (the code before the fix): keeps floor(E/g)*g even below a kept mark, where the
    pass runs through it inside one chunk (grid_rows not a multiple of g)."""
    got = keep_rows(kind, rows, starts, resume, cfg, facts)
    if kind is PassKind.WARM and cfg.cache_enabled:
        end = warm_end_row(rows, (*check_starts(rows, starts), rows), cfg, facts)
        if end is not None and end > resume:
            return tuple(sorted({*got, KeepRow(end)}, key=lambda k: k.row))
    return got


# --- properties ------------------------------------------------------------------------------
@given(keep_examples())
def test_keep_rows(example):
    check_keep_rows(keep_rows, example)


def test_misaligned_warm_end_is_refused_by_resume_row():
    """Hypothesis' counterexample (session 14): max_chunk_rows 64 off the invariant grid 50,
    starts snapped. The warm pass before a 445-row request (start 444) keeps 168, 336 and
    floor(444 / 50) * 50 = 400 over the chunk [336, 400); the request's fresh plan splits
    [336, 444) at 384, so 400's bits differ and resume_row takes 336, not 400."""
    cfg = PolicyConfig(grid_rows=168, max_chunk_rows=64, request_starts=True)
    facts = BackendFacts(invariant_rows=50)
    assert snapping(cfg, facts) and _misaligned(cfg, facts)
    keeps = keep_rows(PassKind.WARM, 444, (), 0, cfg, facts)
    assert [k.row for k in keeps] == [168, 336, 400]
    warm_cuts = [c.start for c in plan_chunks(400, (), 0, cfg, reads_logits=False) if c.start > 0]
    assert warm_cuts[-1] == 336 and 384 in fresh_cuts(445, (444,), cfg)
    kept = [KeptRow(k.row, cut_fingerprint(warm_cuts, k.row, facts)) for k in keeps]
    assert resume_row(445, (444,), cfg, facts, kept) == 336


@given(keep_examples(real=True))
def test_keep_rows_at_4096(example):
    check_keep_rows(keep_rows, example)


def test_catches_a_cold_pass_that_forgets_the_last_start():
    assert_caught(keep_examples(), lambda ex: check_keep_rows(keep_forgets_last_start, ex))


def test_catches_a_warm_pass_that_keeps_an_unusable_end():
    assert_caught(keep_examples(), lambda ex: check_keep_rows(keep_warm_end_always, ex))


def test_catches_a_pass_that_keeps_its_resume_row():
    assert_caught(keep_examples(), lambda ex: check_keep_rows(keep_includes_resume, ex))


def test_catches_a_warm_end_below_a_mark():
    assert_caught(keep_examples(), lambda ex: check_keep_rows(keep_warm_end_below_mark, ex))
