"""Chunk plans (DESIGN rule 1): where a prefill pass over rows [resume, L) is cut.

Only positions live here; which rows are kept is `keep.py`, which rows may be resumed
is `usable.py`.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from policy.config import PolicyConfig


@attrs.frozen
class Chunk:
    """Prefill rows [start, end) of one pass; `reads_logits` when its last row's logits are read."""

    start: int
    end: int
    reads_logits: bool = False

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"chunk needs 0 <= start < end, got [{self.start}, {self.end})")

    @property
    def rows(self) -> int:
        """Rows in the chunk."""
        return self.end - self.start


def check_starts(prompt_rows: int, starts: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated request starts; each must lie in [0, prompt_rows).

    Raises:
      ValueError: a start outside [0, prompt_rows) (named with its value).
    """
    out = tuple(sorted(set(starts)))
    for s in out:
        if not 0 <= s < prompt_rows:
            raise ValueError(f"request start {s} outside [0, {prompt_rows})")
    return out


def fresh_cuts(prompt_rows: int, starts: Iterable[int], cfg: PolicyConfig) -> tuple[int, ...]:
    """Cuts of the fresh plan of a prompt of `prompt_rows` rows, ascending, all in (0, L).

    Hard cuts: every mark (multiple of grid_rows) and, when cfg.request_starts, every
    request start > 0. A span between hard cuts (or 0 and L) longer than max_chunk_rows is
    also cut at each absolute multiple of max_chunk_rows inside it, so no split depends
    on where a pass begins.

    Raises:
      ValueError: prompt_rows < 0 or a start outside [0, prompt_rows).
    """
    if prompt_rows < 0:
        raise ValueError(f"prompt_rows must be >= 0, got {prompt_rows}")
    hard = set(range(cfg.grid_rows, prompt_rows, cfg.grid_rows))
    checked = check_starts(prompt_rows, starts)
    if cfg.request_starts:
        hard.update(s for s in checked if s > 0)
    bounds = [0, *sorted(hard), prompt_rows]
    cuts: list[int] = []
    step = cfg.max_chunk_rows
    for a, b in zip(bounds, bounds[1:]):
        if b - a > step:
            cuts.extend(range((a // step + 1) * step, b, step))
        if b < prompt_rows:
            cuts.append(b)
    return tuple(cuts)


def plan_chunks(
    prompt_rows: int,
    starts: Iterable[int],
    resume: int,
    cfg: PolicyConfig,
    *,
    reads_logits: bool = True,
) -> tuple[Chunk, ...]:
    """The chunks [resume, c1), [c1, c2), ... [ck, L) that prefill rows [resume, L) (rule 1).

    The cuts are exactly the fresh plan's cuts (`fresh_cuts`) that lie after `resume`, so
    for every usable resume row R the plan from R is R followed by the fresh plan's cuts
    after R. `reads_logits` marks the last chunk as one whose last row's logits are read
    (a cold pass); a warm pass passes False.

    Raises:
      ValueError: resume outside [0, prompt_rows], or a bad start.
    """
    if not 0 <= resume <= prompt_rows:
        raise ValueError(f"resume {resume} outside [0, {prompt_rows}]")
    edges = [resume, *(c for c in fresh_cuts(prompt_rows, starts, cfg) if c > resume)]
    if resume < prompt_rows:
        edges.append(prompt_rows)
    last = len(edges) - 2
    return tuple(
        Chunk(a, b, reads_logits and i == last) for i, (a, b) in enumerate(zip(edges, edges[1:]))
    )
