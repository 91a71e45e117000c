"""Shared strategies, oracles and the planted-bug runner for the policy property tests.

Strategies draw prompts (rows, request starts) with configs and backend facts, densely at
small grid_rows / max_chunk_rows (16..512) and a few at the real 4096 grid. Oracles restate
a rule from DESIGN.md in the plainest code. `assert_caught` runs a property against a
planted wrong implementation and fails unless Hypothesis finds a counterexample.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from policy.config import PolicyConfig
from policy.usable import BackendFacts

CONTROL = settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.generate,),
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)
"""Settings for planted-bug controls: deterministic, no shrinking (only 'is it caught')."""


def assert_caught(strategy: st.SearchStrategy, check: Callable[[Any], None]) -> None:
    """Fail unless `check` raises AssertionError on some example drawn from `strategy`."""

    @CONTROL
    @given(strategy)
    def run(example: Any) -> None:
        check(example)

    with pytest.raises(AssertionError):
        run()


@attrs.frozen
class Case:
    """A prompt of `rows` rows with request `starts`, planned under `cfg` on a backend `facts`."""

    rows: int
    starts: tuple[int, ...]
    cfg: PolicyConfig
    facts: BackendFacts

    @property
    def grid(self) -> int | None:
        return self.facts.invariant_rows


def small_configs(**fixed: Any) -> st.SearchStrategy[PolicyConfig]:
    """Configs with grid_rows and max_chunk_rows in 16..512, so every rule fires often."""
    fields = dict(
        grid_rows=st.one_of(st.sampled_from([16, 64, 100, 128, 256]), st.integers(16, 512)),
        max_chunk_rows=st.one_of(st.sampled_from([16, 48, 64, 100, 512]), st.integers(16, 512)),
        request_starts=st.booleans(),
    )
    fields.update({k: st.just(v) for k, v in fixed.items()})
    return st.builds(PolicyConfig, **fields)


def real_configs() -> st.SearchStrategy[PolicyConfig]:
    """The real 4096 grid, with the default split or an awkward one."""
    return st.builds(
        PolicyConfig,
        max_chunk_rows=st.sampled_from([4096, 1024, 1000, 3000, 8192]),
        request_starts=st.booleans(),
    )


def facts_strategy(real: bool = False) -> st.SearchStrategy[BackendFacts]:
    grids = st.sampled_from([64]) if real else st.one_of(
        st.sampled_from([16, 32, 64]), st.integers(2, 100)
    )
    return st.builds(BackendFacts, invariant_rows=st.one_of(st.none(), grids))


SMALL_CONFIGS = small_configs()
REAL_CONFIGS = real_configs()
SMALL_FACTS = facts_strategy()
REAL_FACTS = facts_strategy(real=True)


@st.composite
def cases(draw: st.DrawFn, *, real: bool = False, cfg: st.SearchStrategy | None = None,
          facts: st.SearchStrategy | None = None, max_rows: int | None = None) -> Case:
    """A prompt: rows in [1, max_rows], starts from 0 and rows that often sit near marks."""
    config = draw(cfg if cfg is not None else (REAL_CONFIGS if real else SMALL_CONFIGS))
    backend = draw(facts if facts is not None else (REAL_FACTS if real else SMALL_FACTS))
    grid = config.grid_rows
    limit = max_rows or (40_000 if real else min(2000, 4 * grid + 64))
    rows = draw(st.integers(1, limit))
    marks = (rows - 1) // grid
    starts = [0] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 10))):
        if marks and draw(st.booleans()):
            row = draw(st.integers(1, marks)) * grid + draw(st.integers(-1, 1))
        else:
            row = draw(st.integers(0, rows - 1))
        if row < rows:
            starts.append(row)
    return Case(rows, tuple(sorted(set(starts))), config, backend)


def oracle_fresh_cuts(rows: int, starts: tuple[int, ...], cfg: PolicyConfig) -> list[int]:
    """Rule 1's fresh cuts, restated: hard cuts (marks; starts > 0 when on), and in a span
    between hard cuts longer than max_chunk_rows, every multiple of max_chunk_rows in it."""
    hard = set(range(cfg.grid_rows, rows, cfg.grid_rows))
    if cfg.request_starts:
        hard |= {s for s in starts if s > 0}
    bounds = sorted(hard | {0, rows})
    cuts = set(hard)
    for a, b in zip(bounds, bounds[1:]):
        if b - a > cfg.max_chunk_rows:
            cuts |= {c for c in range(a + 1, b) if c % cfg.max_chunk_rows == 0}
    return sorted(cuts)


def oracle_usable(case: Case, row: int, has_logits: bool = False) -> bool:
    """Rule 2, restated (tokens assumed equal): a fresh cut, a row on the invariant grid,
    or the prompt's end with its logits kept."""
    if row == case.rows:
        return has_logits and row > 0
    if not 0 < row < case.rows:
        return False
    g = case.grid
    return (g is not None and row % g == 0) or row in oracle_fresh_cuts(case.rows, case.starts, case.cfg)


def oracle_fingerprint(cuts: list[int] | tuple[int, ...], row: int, facts: BackendFacts) -> tuple[int, ...]:
    """Cuts below `row` that decide the bits there: every one, except those on the grid."""
    g = facts.invariant_rows
    return tuple(c for c in sorted(cuts) if c < row and not (g is not None and c % g == 0))


def usable_resume_rows(case: Case) -> list[int]:
    """Every row a request for `case` may resume from, below its end: 0, the fresh cuts,
    and the rows on the invariant grid."""
    rows = {0, *oracle_fresh_cuts(case.rows, case.starts, case.cfg)}
    if case.grid is not None:
        rows |= set(range(case.grid, case.rows, case.grid))
    return sorted(rows)


@st.composite
def cases_with_resume(draw: st.DrawFn, **kwargs: Any) -> tuple[Case, int]:
    """A case and a usable resume row of it (0, a fresh cut or an invariant-grid row)."""
    case = draw(cases(**kwargs))
    return case, draw(st.sampled_from(usable_resume_rows(case)))


def probe_rows(case: Case, extra: list[int]) -> set[int]:
    """Rows in (0, L) to probe: all of them up to 512 rows; above, every fresh cut and grid
    row and their neighbours, the ends, and `extra`."""
    if case.rows <= 512:
        return set(range(1, case.rows))
    seeds = {1, case.rows - 1, *extra, *oracle_fresh_cuts(case.rows, case.starts, case.cfg)}
    if case.grid is not None:
        seeds |= set(range(case.grid, case.rows, case.grid)[:200])
    return {r + d for r in seeds for d in (-1, 0, 1) if 0 < r + d < case.rows}
