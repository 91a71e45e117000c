"""Which rows a pass keeps (DESIGN rule 3). Prices live in `shape.py`, room in `store.py`."""

from __future__ import annotations

import enum
from typing import Iterable

import attrs

from policy.config import PolicyConfig
from policy.plan import check_starts, fresh_cuts
from policy.usable import BackendFacts, warm_end_row


class PassKind(enum.Enum):
    """A cold pass has a waiting client; a warm pass pre-fills the next turn in the background."""

    COLD = "cold"
    WARM = "warm"


@attrs.frozen
class KeepRow:
    """A row a pass keeps a state at; `with_logits` when its last-row logits are kept too."""

    row: int
    with_logits: bool = False


def keep_rows(
    kind: PassKind,
    prompt_rows: int,
    starts: Iterable[int],
    resume: int,
    cfg: PolicyConfig,
    facts: BackendFacts,
) -> tuple[KeepRow, ...]:
    """Rows, ascending, at which a pass over [resume, L) keeps a state (rule 3).

    Every mark in (resume, L); when request starts are on, the first request start after
    row 0 (the system cut, when the prompt opens with a system message) and the last
    request start below L, if they lie after `resume`; and the end:
      - cold pass: L itself with its last-row logits (usable by an identical prompt, e.g.
        after a `max_tokens: 0` primer);
      - warm pass: `warm_end_row(L, starts + (L,))`, since L is where the next turn's new
        message starts (rule 2); nothing when that is None, or when that row lies below a
        kept mark without being a cut (the pass runs through it in one chunk: grid_rows
        not a multiple of the invariant grid).
    With the cache off (prompt_cache_bytes == 0) nothing is kept.
    """
    if not cfg.cache_enabled or resume >= prompt_rows:
        return ()
    starts = check_starts(prompt_rows, starts)
    rows: dict[int, bool] = {m: False for m in range(cfg.grid_rows, prompt_rows, cfg.grid_rows)}
    if cfg.request_starts:
        inner = [s for s in starts if s > 0]
        if inner:
            rows[inner[0]] = False
            rows[inner[-1]] = False
    if kind is PassKind.COLD:
        rows[prompt_rows] = True
    else:
        end = warm_end_row(prompt_rows, (*starts, prompt_rows), cfg, facts)
        if end is not None and (end > max(rows, default=0) or end in fresh_cuts(prompt_rows, starts, cfg)):
            rows[end] = False
    return tuple(KeepRow(r, rows[r]) for r in sorted(rows) if r > resume)
