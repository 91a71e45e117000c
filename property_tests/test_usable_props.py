"""Rules 2 and 5 properties: usable rows, the longest usable kept row, the warm-end rule.

Each property is a `check_*` function over the implementation under test; it runs against
the real one (must hold) and a planted wrong one (Hypothesis must catch it).
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
    probe_rows,
)

from policy.plan import fresh_cuts
from policy.usable import (
    BackendFacts,
    KeptRow,
    cut_fingerprint,
    is_usable,
    resume_row,
    warm_end_row,
)

NO_GRID = st.just(BackendFacts())
GRIDS = st.builds(BackendFacts, invariant_rows=st.one_of(st.sampled_from([16, 32, 64]), st.integers(2, 100)))


def probed(strategy) -> st.SearchStrategy[tuple[Case, set[int]]]:
    """A case and the rows in (0, L) to probe in it."""
    return strategy.flatmap(
        lambda c: st.lists(st.integers(1, max(1, c.rows - 1)), max_size=20).map(
            lambda extra: (c, probe_rows(c, extra))
        )
    )


def check_usable_without_grid(usable_fn, example) -> None:
    """No invariant grid: a row in (0, L) is usable iff the fresh plan cuts there."""
    case, rows = example
    fresh = set(oracle_fresh_cuts(case.rows, case.starts, case.cfg))
    accepted = {r for r in rows if usable_fn(r, case.rows, case.starts, case.cfg, case.facts)}
    assert accepted <= fresh, f"accepts rows {sorted(accepted - fresh)} no fresh plan cuts"
    assert accepted == fresh & rows, f"refuses fresh cuts {sorted((fresh & rows) - accepted)}"


def check_usable_with_grid(usable_fn, example) -> None:
    """Invariant grid g: the usable rows in (0, L) are exactly the multiples of g plus the
    fresh plan's cuts."""
    case, rows = example
    g = case.grid
    fresh = set(oracle_fresh_cuts(case.rows, case.starts, case.cfg))
    expected = {r for r in rows if r % g == 0 or r in fresh}
    accepted = {r for r in rows if usable_fn(r, case.rows, case.starts, case.cfg, case.facts)}
    assert accepted == expected, (
        f"g={g}: extra {sorted(accepted - expected)}, missing {sorted(expected - accepted)}"
    )


def check_usable_at_the_ends(usable_fn, example) -> None:
    """Row L is usable iff its logits were kept; rows <= 0 or > L never are."""
    case, has_logits = example
    L = case.rows
    assert usable_fn(L, L, case.starts, case.cfg, case.facts, has_logits=has_logits) is has_logits
    for row in (0, -1, L + 1, L + case.cfg.grid_rows):
        assert not usable_fn(row, L, case.starts, case.cfg, case.facts, has_logits=True), row


@st.composite
def kept_rows(draw, case: Case) -> list[KeptRow]:
    """Kept states whose tokens match: at cuts, grid rows, the end or anywhere, with the
    fresh plan's fingerprint or a wrong one, with or without logits."""
    cuts = oracle_fresh_cuts(case.rows, case.starts, case.cfg)
    grid = list(range(case.grid, case.rows + 1, case.grid)) if case.grid else []
    row_s = st.one_of(
        st.integers(1, case.rows),
        st.just(case.rows),
        *([st.sampled_from(cuts)] if cuts else []),
        *([st.sampled_from(grid)] if grid else []),
    )
    out = []
    for _ in range(draw(st.integers(0, 8))):
        row = draw(row_s)
        fp = oracle_fingerprint(cuts, row, case.facts)
        how = draw(st.sampled_from(["fresh", "fresh", "drop", "extra"]))
        if how == "drop" and fp:
            fp = fp[:-1]
        elif how == "extra" and row > 1:
            fp = tuple(sorted({*fp, draw(st.integers(1, row - 1))}))
        out.append(KeptRow(row, fp, draw(st.booleans())))
    return out


def check_resume_row(resume_fn, example) -> None:
    """Rule 5: the longest kept row that is usable and whose fingerprint equals the
    request's fresh-plan fingerprint there, else 0."""
    case, kept = example
    cuts = oracle_fresh_cuts(case.rows, case.starts, case.cfg)
    good = [
        k.row for k in kept
        if oracle_usable(case, k.row, k.has_logits) and k.fingerprint == oracle_fingerprint(cuts, k.row, case.facts)
    ]
    assert resume_fn(case.rows, case.starts, case.cfg, case.facts, kept) == max(good, default=0)


@st.composite
def warm_ends(draw, real: bool = False):
    """(E, next turn's starts below E, cfg, facts, the next request's rows L' > E and starts)."""
    case = draw(cases(real=real))
    end = case.rows
    extra = draw(st.lists(st.integers(end, end + 3 * case.cfg.grid_rows), max_size=3))
    next_rows = draw(st.integers(end + 1, end + 4 * case.cfg.grid_rows))
    tail = tuple(s for s in extra if s < next_rows)
    on = draw(st.booleans())  # the end is the next turn's message start (always, in chat)
    return case, ((end,) if on else ()), next_rows, tail


def check_warm_end(warm_fn, example) -> None:
    """warm_end_row keeps a start or mark end E, floor(E/g)*g with a grid, else None; and
    what it keeps is usable by the next turn's fresh request."""
    case, end_start, next_rows, tail = example
    cfg, facts, E = case.cfg, case.facts, case.rows
    next_starts = (*case.starts, *end_start)
    got = warm_fn(E, next_starts, cfg, facts)
    snapped = cfg.request_starts and cfg.snap_starts and facts.invariant_rows is not None
    if E % cfg.grid_rows == 0 or (cfg.request_starts and not snapped and E in next_starts):
        assert got == E
    elif facts.invariant_rows is not None and E // facts.invariant_rows > 0:
        assert got == E // facts.invariant_rows * facts.invariant_rows
    else:
        assert got is None
    if got is not None:
        request = Case(next_rows, tuple(sorted({*next_starts, *tail})), cfg, facts)
        assert 0 < got <= E and oracle_usable(request, got), (got, request)


# --- planted wrong implementations -------------------------------------------------------
def usable_any_row(row, prompt_rows, starts, cfg, facts, *, has_logits=False):
    """Wrong: every row inside the prompt is usable."""
    return 0 < row < prompt_rows or (row == prompt_rows and has_logits)


def usable_ignores_grid(row, prompt_rows, starts, cfg, facts, *, has_logits=False):
    """Wrong: forgets the invariant grid (rule 2b)."""
    return is_usable(row, prompt_rows, starts, cfg, BackendFacts(), has_logits=has_logits)


def usable_end_without_logits(row, prompt_rows, starts, cfg, facts, *, has_logits=False):
    """Wrong: the prompt's end is usable even when its logits were not kept."""
    return is_usable(row, prompt_rows, starts, cfg, facts, has_logits=True)


def resume_ignores_fingerprint(prompt_rows, starts, cfg, facts, kept):
    """Wrong: any usable row, whatever cuts made its bits."""
    return resume_row(
        prompt_rows, starts, cfg, facts,
        [KeptRow(k.row, cut_fingerprint(fresh_cuts(prompt_rows, starts, cfg), k.row, facts), k.has_logits)
         for k in kept],
    )


def resume_first_usable(prompt_rows, starts, cfg, facts, kept):
    """Wrong: the first usable kept row, not the longest."""
    for k in kept:
        best = resume_row(prompt_rows, starts, cfg, facts, [k])
        if best:
            return best
    return 0


def warm_end_keeps_any_length(end_row, next_starts, cfg, facts):
    """Wrong: keeps its end whatever its length (the end is not always usable)."""
    return end_row if end_row > 0 else None


def warm_end_rounds_up(end_row, next_starts, cfg, facts):
    """Wrong: rounds the end up to the grid instead of down."""
    got = warm_end_row(end_row, next_starts, cfg, facts)
    g = facts.invariant_rows
    if got is not None and got != end_row and g is not None:
        return -(-end_row // g) * g
    return got


# --- properties ------------------------------------------------------------------------------
@given(probed(cases(facts=NO_GRID)))
def test_usable_without_grid_only_fresh_cuts(example):
    check_usable_without_grid(is_usable, example)


@given(probed(cases(facts=GRIDS)))
def test_usable_with_grid_is_grid_plus_fresh_cuts(example):
    check_usable_with_grid(is_usable, example)


@given(probed(cases(real=True, facts=st.just(BackendFacts(invariant_rows=64)))))
def test_usable_with_grid_at_4096(example):
    check_usable_with_grid(is_usable, example)


@given(st.tuples(cases(), st.booleans()))
def test_usable_at_the_ends(example):
    check_usable_at_the_ends(is_usable, example)


@given(cases().flatmap(lambda c: st.tuples(st.just(c), kept_rows(c))))
def test_resume_row_is_the_longest_usable(example):
    check_resume_row(resume_row, example)


@given(warm_ends())
def test_warm_end_row(example):
    check_warm_end(warm_end_row, example)


@given(warm_ends(real=True))
def test_warm_end_row_at_4096(example):
    check_warm_end(warm_end_row, example)


# --- planted bugs are caught ---------------------------------------------------------------
def test_catches_a_usable_rule_that_accepts_any_row():
    assert_caught(probed(cases(facts=NO_GRID)), lambda ex: check_usable_without_grid(usable_any_row, ex))


def test_catches_a_usable_rule_that_ignores_the_grid():
    assert_caught(probed(cases(facts=GRIDS)), lambda ex: check_usable_with_grid(usable_ignores_grid, ex))


def test_catches_an_end_usable_without_logits():
    assert_caught(st.tuples(cases(), st.booleans()), lambda ex: check_usable_at_the_ends(usable_end_without_logits, ex))


def test_catches_a_resume_row_that_ignores_fingerprints():
    strategy = cases().flatmap(lambda c: st.tuples(st.just(c), kept_rows(c)))
    assert_caught(strategy, lambda ex: check_resume_row(resume_ignores_fingerprint, ex))


def test_catches_a_resume_row_that_is_not_the_longest():
    strategy = cases().flatmap(lambda c: st.tuples(st.just(c), kept_rows(c)))
    assert_caught(strategy, lambda ex: check_resume_row(resume_first_usable, ex))


def test_catches_a_warm_end_kept_at_any_length():
    assert_caught(warm_ends(), lambda ex: check_warm_end(warm_end_keeps_any_length, ex))


def test_catches_a_warm_end_rounded_up():
    assert_caught(warm_ends(), lambda ex: check_warm_end(warm_end_rounds_up, ex))
