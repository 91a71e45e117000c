"""Trace events: one frozen class per decision the scheduler makes.

The simulator and the executor write the same events (JSONL via `event_dict`), so a sim
trace and a server trace of one workload compare line by line. Times `t` are seconds on
the driver's clock; rows are prompt rows; bytes are prompt-cache bytes.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Event:
    """Base: every event has a time `t` (s) and a stable snake_case `kind`."""

    t: float

    kind: str = attrs.field(init=False, default="event")


def _kind(name: str) -> Any:
    return attrs.field(init=False, default=name)


@attrs.frozen(kw_only=True)
class RequestArrived(Event):
    """A request reached the scheduler: prompt `rows`, `max_tokens` to generate."""

    request: str
    conversation: str
    rows: int
    max_tokens: int
    kind: str = _kind("request_arrived")


@attrs.frozen(kw_only=True)
class RequestRejected(Event):
    """A request was refused before admission, with the `reason` (e.g. queue_full)."""

    request: str
    conversation: str
    reason: str
    kind: str = _kind("request_rejected")


@attrs.frozen(kw_only=True)
class RequestAdmitted(Event):
    """A request got a lane (`stream`); it resumes at row `cached_tokens` from `source`."""

    request: str
    conversation: str
    stream: int
    rows: int
    cached_tokens: int
    source: str  # "store", "warm" (adopted) or "none"
    kind: str = _kind("request_admitted")


@attrs.frozen(kw_only=True)
class ChunkStarted(Event):
    """A prefill chunk [start, end) of a cold or warm pass began; `tail_from` per rule 8,
    `restore_row` when the pass first restores a kept state at that row."""

    stream: int
    request: str | None
    conversation: str
    pass_kind: str  # "cold" or "warm"
    start: int
    end: int
    tail_from: int | None
    restore_row: int | None
    kind: str = _kind("chunk_started")


@attrs.frozen(kw_only=True)
class ChunkDone(Event):
    """A prefill chunk [start, end) finished."""

    stream: int
    request: str | None
    conversation: str
    pass_kind: str
    start: int
    end: int
    kind: str = _kind("chunk_done")


@attrs.frozen(kw_only=True)
class FirstToken(Event):
    """A request's first token is ready; `ttft_s` is seconds since it arrived."""

    request: str
    conversation: str
    stream: int
    ttft_s: float
    kind: str = _kind("first_token")


@attrs.frozen(kw_only=True)
class StateKept(Event):
    """A state at `row` entered the prompt cache as `entry`, adding `bytes` (rule 3)."""

    stream: int
    conversation: str
    entry: int
    row: int
    bytes: int
    logits: bool
    kind: str = _kind("state_kept")


@attrs.frozen(kw_only=True)
class KeepRefused(Event):
    """A keep at `row` was refused (`reason`: over_budget or cache_off)."""

    stream: int
    conversation: str
    row: int
    reason: str
    kind: str = _kind("keep_refused")


@attrs.frozen(kw_only=True)
class StateEvicted(Event):
    """Entry `entry` at `row` was evicted (rule 4): `how` is ghost or freed."""

    entry: int
    row: int
    bytes: int
    how: str  # "ghost" or "freed"
    kind: str = _kind("state_evicted")


@attrs.frozen(kw_only=True)
class WarmScheduled(Event):
    """A warm pass of `rows` rows was scheduled after request `after`'s reply ended."""

    conversation: str
    after: str  # the request whose reply ended
    rows: int
    kind: str = _kind("warm_scheduled")


@attrs.frozen(kw_only=True)
class WarmStarted(Event):
    """A warm pass began on `stream`, resuming at `resume` and planned to end at `end`."""

    conversation: str
    stream: int
    resume: int
    end: int
    kind: str = _kind("warm_started")


@attrs.frozen(kw_only=True)
class WarmYielded(Event):
    """A warm pass at `row` gave way to foreground work between chunks (rule 6)."""

    conversation: str
    stream: int
    row: int
    kind: str = _kind("warm_yielded")


@attrs.frozen(kw_only=True)
class WarmCancelled(Event):
    """A warm pass was cancelled at `row` (`reason`: nothing_usable, already_kept,
    superseded, warm_off)."""

    conversation: str
    row: int
    reason: str
    kind: str = _kind("warm_cancelled")


@attrs.frozen(kw_only=True)
class WarmAdopted(Event):
    """Request `request` took over the warm pass's `stream` at `row` (rule 6)."""

    conversation: str
    request: str
    stream: int
    row: int
    kind: str = _kind("warm_adopted")


@attrs.frozen(kw_only=True)
class WarmFinished(Event):
    """A warm pass reached its end `row` and released its stream."""

    conversation: str
    stream: int
    row: int
    kind: str = _kind("warm_finished")


@attrs.frozen(kw_only=True)
class RequestFinished(Event):
    """A request ended: `reason` stop, length or cancelled; rows, cached_tokens, output_rows."""

    request: str
    conversation: str
    reason: str  # "stop", "length", "cancelled"
    rows: int
    cached_tokens: int
    output_rows: int
    kind: str = _kind("request_finished")


def event_dict(event: Event) -> dict[str, Any]:
    """The event as a flat dict with `kind` and `t` first (the JSONL trace line)."""
    d = attrs.asdict(event)
    return {"kind": d.pop("kind"), "t": d.pop("t"), **d}
