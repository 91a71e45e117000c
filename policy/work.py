"""Values that cross the scheduler's seam: requests in, steps and effects out.

The scheduler (`policy.scheduler`) makes them; drivers (the simulator, the executor's
runtime) read them. Mutable bookkeeping stays inside the scheduler.
"""

from __future__ import annotations

import attrs

from policy.keep import KeepRow, PassKind
from policy.plan import Chunk
from policy.prefix import Prompt
from policy.store import Entry, EvictKind, KeepCopy


@attrs.frozen(kw_only=True)
class Request:
    """One client request: its prompt (rows), request starts, and what follows it.

    continuation: the prefix the next turn will send (history + this reply rendered as the
    next request renders it), or None; a warm pass pre-fills it after the reply.
    has_reader: something reads the last layer's hidden rows (forbids the tail, rule 8).
    """

    id: str
    conversation: str
    prompt: Prompt
    starts: tuple[int, ...]
    max_tokens: int
    continuation: Prompt | None = None
    continuation_starts: tuple[int, ...] = ()
    has_reader: bool = False


@attrs.frozen
class ChunkRun:
    """Run `chunk` of `stream` (restoring `restore` first when set), tail from `tail_from`,
    then keep `keep` when set, copying what `keep_copy` says (`Store.keep_copy`)."""

    stream: int
    kind: PassKind
    request: str | None
    conversation: str
    chunk: Chunk
    tail_from: int | None
    restore: Entry | None
    keep: KeepRow | None
    keep_copy: KeepCopy | None = None


@attrs.frozen
class Step:
    """One round: a decode step of `decode` lanes (`rounds` times) plus at most one chunk.

    contexts: per decoding lane, rows already in its context. restores: lanes whose first
    token comes from a kept state's logits (restore only, no compute).
    """

    decode: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: ChunkRun | None
    restores: tuple[tuple[int, Entry], ...] = ()
    rounds: int = 1


@attrs.frozen
class Kept:
    """Effect: snapshot `stream` at `entry.row` into the store's `entry`."""

    stream: int
    entry: Entry


@attrs.frozen
class Evicted:
    """Effect: release `entry`'s payload (fixed part for GHOST, all for FREED)."""

    entry: Entry
    how: EvictKind


@attrs.frozen
class Released:
    """Effect: the stream's state is no longer needed."""

    stream: int


@attrs.frozen
class Finished:
    """Effect: a request ended (reason "stop", "length", "cancelled" or "rejected: ...")."""

    request: str
    reason: str
    cached_tokens: int
