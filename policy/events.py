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
    request: str
    conversation: str
    rows: int
    max_tokens: int
    kind: str = _kind("request_arrived")


@attrs.frozen(kw_only=True)
class RequestRejected(Event):
    request: str
    conversation: str
    reason: str
    kind: str = _kind("request_rejected")


@attrs.frozen(kw_only=True)
class RequestAdmitted(Event):
    request: str
    conversation: str
    stream: int
    rows: int
    cached_tokens: int
    source: str  # "store", "warm" (adopted) or "none"
    kind: str = _kind("request_admitted")


@attrs.frozen(kw_only=True)
class ChunkStarted(Event):
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
    stream: int
    request: str | None
    conversation: str
    pass_kind: str
    start: int
    end: int
    kind: str = _kind("chunk_done")


@attrs.frozen(kw_only=True)
class FirstToken(Event):
    request: str
    conversation: str
    stream: int
    ttft_s: float
    kind: str = _kind("first_token")


@attrs.frozen(kw_only=True)
class StateKept(Event):
    stream: int
    conversation: str
    entry: int
    row: int
    bytes: int
    logits: bool
    kind: str = _kind("state_kept")


@attrs.frozen(kw_only=True)
class KeepRefused(Event):
    stream: int
    conversation: str
    row: int
    reason: str
    kind: str = _kind("keep_refused")


@attrs.frozen(kw_only=True)
class StateEvicted(Event):
    entry: int
    row: int
    bytes: int
    how: str  # "ghost" or "freed"
    kind: str = _kind("state_evicted")


@attrs.frozen(kw_only=True)
class WarmScheduled(Event):
    conversation: str
    after: str  # the request whose reply ended
    rows: int
    kind: str = _kind("warm_scheduled")


@attrs.frozen(kw_only=True)
class WarmStarted(Event):
    conversation: str
    stream: int
    resume: int
    end: int
    kind: str = _kind("warm_started")


@attrs.frozen(kw_only=True)
class WarmYielded(Event):
    conversation: str
    stream: int
    row: int
    kind: str = _kind("warm_yielded")


@attrs.frozen(kw_only=True)
class WarmCancelled(Event):
    conversation: str
    row: int
    reason: str
    kind: str = _kind("warm_cancelled")


@attrs.frozen(kw_only=True)
class WarmAdopted(Event):
    conversation: str
    request: str
    stream: int
    row: int
    kind: str = _kind("warm_adopted")


@attrs.frozen(kw_only=True)
class WarmFinished(Event):
    conversation: str
    stream: int
    row: int
    kind: str = _kind("warm_finished")


@attrs.frozen(kw_only=True)
class RequestFinished(Event):
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
