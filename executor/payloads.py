"""What the prompt cache holds in the executor: backend snapshots with their logits.

The scheduler's store (`policy.store`) prices and indexes kept states; each entry's
`payload` is a `Payload` made here. Also the `ModelShape` that prices a Qwen3.5 config,
so the store's bytes equal `Qwen35Config.state_bytes`. No scheduling decisions here.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from executor.backend import Backend
from executor.config import Qwen35Config
from policy.shape import ModelShape


@attrs.frozen(eq=False)
class Payload:
    """A kept state: the backend's immutable snapshot at `rows`, the float32 logits [vocab]
    of row rows - 1 when they were kept (else None), and its serving-format bytes."""

    snapshot: Any
    rows: int
    logits: np.ndarray | None
    bytes: int


def model_shape(config: Qwen35Config) -> ModelShape:
    """The state-sizing facts of `config`: state_bytes(shape, P) == config.state_bytes(P)."""
    return config.shape


def snapshot(backend: Backend, state: Any, logits: np.ndarray | None) -> Payload:
    """Copy `state` (at its current row) into a payload; `logits` of its last row or None."""
    snap = backend.snapshot(state)
    kept = None
    if logits is not None:
        kept = np.array(logits, dtype=np.float32, copy=True)
        kept.flags.writeable = False
    return Payload(snap, int(snap.rows), kept, int(backend.payload_bytes(snap)))


def restore(backend: Backend, payload: Payload) -> Any:
    """A fresh state equal to the one `payload` copied (the payload stays reusable).

    Raises ValueError when the payload is missing (a keep whose snapshot failed).
    """
    if not isinstance(payload, Payload):
        raise ValueError("kept state has no payload (its snapshot failed)")
    return backend.restore(payload.snapshot)


def release(backend: Backend, state: Any) -> None:
    """Give a stream's state back (backends with a state pool have `release`)."""
    give = getattr(backend, "release", None)
    if give is not None:
        give(state)
