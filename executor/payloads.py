"""What the prompt cache holds in the executor: backend snapshots with their logits.

The scheduler's store (`policy.store`) prices and indexes kept states; each entry's
`payload` is a `Payload` made here. Also the `ModelShape` that prices a Qwen3.5 config,
so the store's bytes equal `Qwen35Config.state_bytes`. No scheduling decisions here.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from executor.backend import Backend, frozen_logits
from executor.config import Qwen35Config
from policy.shape import ModelShape


@attrs.frozen(eq=False)
class Payload:
    """A kept state: the backend's immutable snapshot at `rows`, the float32 logits [vocab]
    of row rows - 1 when they were kept (else None), the bytes it holds itself
    (`Backend.payload_bytes`), and kv_from, the first K/V row it holds itself (rows below
    are shared with the payload it was built on). ghost: made by `ghost` (not restorable)."""

    snapshot: Any
    rows: int
    logits: np.ndarray | None
    bytes: int
    kv_from: int = 0
    ghost: bool = False


def model_shape(config: Qwen35Config) -> ModelShape:
    """The state-sizing facts of `config`: state_bytes(shape, P) == config.state_bytes(P)."""
    return config.shape


def snapshot(backend: Backend, state: Any, logits: np.ndarray | None, base: Payload | None = None) -> Payload:
    """Copy `state` (at its current row) into a payload; `logits` of its last row or None.

    base: the payload of the store entry this keep builds on (`policy.store.KeepCopy.base`:
    the parent of a new entry, the ghost itself when a ghost comes back), whose K/V rows
    the new payload shares (`Backend.snapshot`). Raises ValueError when base holds more
    rows than the state.
    """
    snap = backend.snapshot(state, None if base is None else base.snapshot)
    return Payload(snap, int(snap.rows), frozen_logits(logits), int(backend.payload_bytes(snap)), int(snap.kv_from))


def with_logits(payload: Payload, logits: np.ndarray) -> Payload:
    """The same kept state with its last row's logits added (`policy.store.Copy.LOGITS`)."""
    return attrs.evolve(payload, logits=frozen_logits(logits))


def ghost(backend: Backend, payload: Payload) -> Payload:
    """The payload of an entry evicted to a ghost: its fixed part and logits go, its own K/V
    rows stay for the longer payloads built on it (`Backend.ghost`)."""
    snap = backend.ghost(payload.snapshot)
    return Payload(snap, payload.rows, None, int(backend.payload_bytes(snap)), payload.kv_from, ghost=True)


def restore(backend: Backend, payload: Payload) -> Any:
    """A fresh state equal to the one `payload` copied (the payload stays reusable).

    Raises ValueError when the payload is missing (a keep whose snapshot failed) or a ghost.
    """
    if not isinstance(payload, Payload):
        raise ValueError("kept state has no payload (its snapshot failed)")
    if payload.ghost:
        raise ValueError(f"the kept state at row {payload.rows} is a ghost (evicted): nothing to restore")
    return backend.restore(payload.snapshot)


def holds_state(payload: Payload | None) -> bool:
    """True for a payload a restore can use (not missing, not a ghost)."""
    return isinstance(payload, Payload) and not payload.ghost


def release(backend: Backend, state: Any) -> None:
    """Give a stream's state back (backends with a state pool have `release`)."""
    give = getattr(backend, "release", None)
    if give is not None:
        give(state)
