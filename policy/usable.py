"""Which kept rows a request may resume from (DESIGN rules 2 and 5), and the warm-end rule.

A kept state is usable only where resuming gives the same bits as a fresh pass. The
backend's proven facts arrive as `BackendFacts`, so one policy serves backends with and
without chunk-invariant numerics.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from policy.config import PolicyConfig
from policy.plan import fresh_cuts


def _grid(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{attribute.name} must be None or a positive integer, got {value!r}")


@attrs.frozen
class BackendFacts:
    """What a backend has proven about its numerics.

    invariant_rows: None, or g such that every prefill kernel gives each row the same bits
      whatever chunk it sits in, as long as the cuts that differ between two plans fall on
      multiples of g rows (cuts off the grid, such as request starts, stay where the fresh
      plan puts them). None when not proven: then only fresh-plan cuts are usable.
    """

    invariant_rows: int | None = attrs.field(default=None, validator=_grid)


Fingerprint = tuple[int, ...]


def snapping(cfg: PolicyConfig, facts: BackendFacts) -> bool:
    """True when request starts snap to the backend's invariant grid (`PolicyConfig.snap_starts`)."""
    return cfg.request_starts and cfg.snap_starts and facts.invariant_rows is not None


def snap_starts(starts: Iterable[int], cfg: PolicyConfig, facts: BackendFacts) -> tuple[int, ...]:
    """The request starts the policy cuts and keeps at: sorted and de-duplicated; when
    `snapping`, each start s becomes floor(s / g) * g for the invariant grid g, and those
    that become 0 are dropped. Starts and result in rows; raises nothing (bounds are
    `check_starts`')."""
    rows = set(starts)
    if snapping(cfg, facts):
        g = facts.invariant_rows
        rows = {s // g * g for s in rows} - {0}
    return tuple(sorted(rows))


def cut_fingerprint(cuts: Iterable[int], row: int, facts: BackendFacts) -> Fingerprint:
    """The cuts below `row` that decide the bits of a state at `row`.

    Every cut < row, except those on the backend's invariant grid (which change no bit).
    A kept state and a request agree at `row` iff their fingerprints there are equal.
    """
    g = facts.invariant_rows
    return tuple(c for c in cuts if c < row and (g is None or c % g != 0))


def is_usable(
    row: int,
    prompt_rows: int,
    starts: Iterable[int],
    cfg: PolicyConfig,
    facts: BackendFacts,
    *,
    has_logits: bool = False,
) -> bool:
    """Rule 2, given that the kept tokens [0, row) match the request's.

    True iff 0 < row < L and (a) row is a cut of the request's fresh plan (a mark, a
    request start when request_starts is on, or a fixed split), or (b) the backend has an
    invariant grid g and row % g == 0; or row == L and the state kept its last-row logits.
    Rows in rows, L = prompt_rows.
    """
    if row == prompt_rows:
        return has_logits and row > 0
    if not 0 < row < prompt_rows:
        return False
    g = facts.invariant_rows
    if g is not None and row % g == 0:
        return True
    return row in fresh_cuts(prompt_rows, starts, cfg)


@attrs.frozen
class KeptRow:
    """A kept state whose tokens [0, row) already match a request: row, fingerprint, logits."""

    row: int
    fingerprint: Fingerprint
    has_logits: bool = False


def resume_row(
    prompt_rows: int,
    starts: Iterable[int],
    cfg: PolicyConfig,
    facts: BackendFacts,
    kept: Iterable[KeptRow],
) -> int:
    """Rule 5: the longest usable row among `kept` (token-matched states), else 0.

    A candidate counts when `is_usable` holds and its fingerprint equals the request's
    fresh-plan fingerprint at that row. The result is the request's cached_tokens.
    """
    starts = tuple(starts)
    cuts = fresh_cuts(prompt_rows, starts, cfg)
    best = 0
    for k in kept:
        if k.row <= best:
            continue
        if k.fingerprint != cut_fingerprint(cuts, k.row, facts):
            continue
        if is_usable(k.row, prompt_rows, starts, cfg, facts, has_logits=k.has_logits):
            best = k.row
    return best


def warm_end_row(
    end_row: int, next_starts: Iterable[int], cfg: PolicyConfig, facts: BackendFacts
) -> int | None:
    """Rule 2's warm-end rule: the row a warm pass over [0, E) keeps at its end, or None.

    E = end_row is where the next turn's new message begins. (a) E is a cut of the next
    request's fresh plan (a mark, or a request start with request_starts on and starts not
    snapped to the grid, `snapping`): keep E. (b) Otherwise, with an invariant grid g: keep
    floor(E / g) * g when > 0. Else None: nothing at the end is usable, which is what the
    earlier engine always had under 4096. With max_chunk_rows not a multiple of g, the next
    request may split its last span where the warm pass did not, so a (b) row can carry
    other bits; `resume_row`'s fingerprint check then refuses it.
    """
    if end_row <= 0:
        return None
    start_cut = cfg.request_starts and not snapping(cfg, facts) and end_row in set(next_starts)
    if end_row % cfg.grid_rows == 0 or start_cut:
        return end_row
    g = facts.invariant_rows
    if g is not None and end_row // g * g > 0:
        return end_row // g * g
    return None
