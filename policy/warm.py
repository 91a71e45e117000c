"""Warm-pass decisions (DESIGN rules 6 and 7) as pure functions over plain values.

When a pass may start (quiet), whether it runs or is cancelled, where it ends, when it
yields, and whether a foreground request adopts it. The scheduler applies them.
"""

from __future__ import annotations

import enum
from typing import Iterable

import attrs

from policy.config import PolicyConfig
from policy.keep import KeepRow, PassKind, keep_rows
from policy.prefix import Prompt
from policy.usable import BackendFacts, Fingerprint, cut_fingerprint, is_usable
from policy.plan import fresh_cuts


def warm_start_s(quiet_since_s: float, cfg: PolicyConfig) -> float:
    """Earliest time (s) a warm pass may start: warm_quiet_ms after the last foreground work."""
    return quiet_since_s + cfg.warm_quiet_ms / 1000.0


def is_quiet(now_s: float, quiet_since_s: float | None, cfg: PolicyConfig) -> bool:
    """Rule 6: True when no foreground work has run for warm_quiet_ms (quiet_since_s None: busy)."""
    return quiet_since_s is not None and now_s >= warm_start_s(quiet_since_s, cfg)


class WarmVerdict(enum.Enum):
    """RUN the warm pass, or CANCEL it before it runs (with a reason)."""

    RUN = "run"
    CANCEL = "cancel"


@attrs.frozen
class WarmDecision:
    """Whether a warm pass runs, its end row (rows [resume, end_row)), and what it keeps."""

    verdict: WarmVerdict
    end_row: int
    keeps: tuple[KeepRow, ...]
    reason: str


def decide_warm(
    prompt_rows: int,
    starts: Iterable[int],
    resume: int,
    cfg: PolicyConfig,
    facts: BackendFacts,
    already_kept: Iterable[int],
) -> WarmDecision:
    """Rule 6: run a warm pass over [resume, end_row) or cancel it before it runs.

    prompt_rows E is the next turn's prefix (history + reply, rendered as the next request
    renders it); starts are its request starts (all < E). The pass keeps `keep_rows(WARM)`
    and ends at the last of them (nothing past it would be kept). It is cancelled when
    warm passes are off, or when every row it would keep is in `already_kept` (or there is
    none): it would keep nothing new.
    """
    if not cfg.warm_active:
        return WarmDecision(WarmVerdict.CANCEL, resume, (), "warm_off")
    keeps = keep_rows(PassKind.WARM, prompt_rows, starts, resume, cfg, facts)
    have = set(already_kept)
    if not keeps:
        return WarmDecision(WarmVerdict.CANCEL, resume, (), "nothing_usable")
    if all(k.row in have for k in keeps):
        return WarmDecision(WarmVerdict.CANCEL, resume, keeps, "already_kept")
    return WarmDecision(WarmVerdict.RUN, keeps[-1].row, keeps, "new_keep")


def should_yield(foreground_waiting: bool) -> bool:
    """Rule 6: between chunks a warm pass gives way to any waiting foreground work."""
    return foreground_waiting


def can_adopt(
    warm_prompt: Prompt,
    warm_row: int,
    warm_fingerprint: Fingerprint,
    request_prompt: Prompt,
    request_starts: Iterable[int],
    cfg: PolicyConfig,
    facts: BackendFacts,
) -> bool:
    """Rule 6: may a foreground request continue the warm pass that reached `warm_row`?

    Yes iff the request's tokens [0, warm_row) equal the warm pass's, warm_row is usable for
    the request (rule 2) and the warm pass's cuts below warm_row match the request's fresh
    plan (equal fingerprints), so continuing gives a fresh run's bits.
    """
    if warm_row <= 0 or warm_row > len(request_prompt) or warm_row > len(warm_prompt):
        return False
    if warm_prompt.digest(warm_row) != request_prompt.digest(warm_row):
        return False
    starts = tuple(request_starts)
    cuts = fresh_cuts(len(request_prompt), starts, cfg)
    if cut_fingerprint(cuts, warm_row, facts) != warm_fingerprint:
        return False
    return is_usable(warm_row, len(request_prompt), starts, cfg, facts)


def finish_reason(max_tokens: int, generated: int, stopped: bool) -> str:
    """OpenAI finish_reason: "stop" when a stop token/string ended it, else "length".

    Rule 7: a prefill-only request (max_tokens == 0) ran a normal cold pass and finishes
    with "length", never "cancelled".
    """
    if max_tokens == 0:
        return "length"
    return "stop" if stopped else "length"
