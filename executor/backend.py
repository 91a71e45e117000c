"""The backend interface every executor backend implements (reference NumPy, numba-cuda).

A backend runs the Qwen3.5 forward for streams whose per-stream state it owns: prefill
of row ranges, one-row decode for many lanes, and snapshot/restore of kept states.
Nothing here computes; see `executor/reference/backend.py` for the oracle.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from executor.config import Qwen35Config


@runtime_checkable
class Backend(Protocol):
    """One model loaded on one device.

    Terms (DESIGN.md): a *state* at row P holds, for every linear-attention layer, the
    fp32 recurrent matrix [value_heads, key_dim, value_dim] and the conv tail
    [kernel - 1, conv_channels] at P, the full-attention layers' K/V rows [0, P), and the
    logits of row P - 1 when the last call computed them. A *payload* is an immutable
    copy of a state, kept in the prompt cache. A state may carry `greedy`: the argmax of
    those logits as np.argmax gives it, computed where the logits were (the numba-cuda
    backend's device), or None; the stepper then picks a greedy lane's token without a
    host pass over the vocabulary (`executor.stepper.Stepper`).

    Contracts (tested): prefill in any chunks equals whole-prompt prefill to float
    tolerance; restore(snapshot(s)) then continuing equals never stopping; a lane's
    decode result does not depend on the other lanes.
    """

    config: Qwen35Config

    def new_state(self) -> Any:
        """An empty state at row 0."""

    def prefill(
        self,
        state: Any,
        token_ids: Sequence[int],
        rows: tuple[int, int],
        want_logits: bool = True,
        tail_from: int | None = None,
    ) -> np.ndarray | None:
        """Compute rows [a, b) of the prompt `token_ids` (the whole prompt, len >= b) into
        `state`, which must hold rows [0, a); afterwards it holds [0, b).

        tail_from (DESIGN rule 8, `policy.tail.tail_from`): None runs the whole last layer
        over every row; t in [a, b) runs its q/attention/gate/o_proj/MLP over rows [t, b)
        only (K/V over all); t == b skips them and the LM head (want_logits must be False).
        A backend may ignore it: the tail changes no bit of the logits it returns.
        Returns the float32 logits [vocab] of row b - 1 when want_logits, else None (possibly
        read-only, shared with the state: the caller must not write into it).
        Raises ValueError naming the argument when rows or the state disagree.
        """

    def decode(self, states: Sequence[Any], token_ids: Sequence[int]) -> np.ndarray:
        """One decode round: lane i feeds token_ids[i] at its state's row P and advances
        to P + 1. Returns float32 logits [lanes, vocab]."""

    def snapshot(self, state: Any, base: Any = None) -> Any:
        """An immutable payload of the state (the state stays usable), with `.rows` and
        `.kv_from`.

        base: None, or a payload (live or ghost) of this very state's prefix, whose K/V rows
        [0, base.rows) equal the state's (the store's parent: same tokens, same cuts; the
        caller's guarantee, DESIGN rule 3). The payload then shares base's K/V rows and
        copies only the fixed part and the rows [base.rows, rows); kv_from is base.rows (0
        without a base), or base.kv_from when base.rows == rows (a ghost revived: the rows it
        holds itself are the ghost's). Raises ValueError when base holds more rows than the
        state.
        """

    def restore(self, payload: Any) -> Any:
        """A fresh state equal to the one snapshotted (the payload stays reusable). Raises
        ValueError for a ghost."""

    def ghost(self, payload: Any) -> Any:
        """The payload without its fixed part and logits: not restorable, still a base whose
        K/V rows longer payloads share (the store's evicted entry that others extend)."""

    def payload_bytes(self, payload: Any) -> int:
        """Bytes the payload holds itself in the serving format: config.state_bytes(0) unless
        a ghost, plus its own K/V rows (rows - kv_from) * config.kv_bytes_per_row. Summed over
        the store's entries it equals the store's bytes_used."""

    def state_bytes(self, state: Any) -> int:
        """Bytes of a live state in the serving format: config.state_bytes(rows)."""

    def release(self, state: Any) -> None:
        """The state is no longer needed (a GPU backend returns its memory to the pool)."""


def shared_segments(base: Any, rows: int) -> tuple[tuple, int]:
    """(K/V segments a snapshot at `rows` shares with `base`, first row it must copy): ((), 0)
    without a base, else (base.segments, base.rows). Raises ValueError when base holds more
    rows than the state (`Backend.snapshot`)."""
    if base is None:
        return (), 0
    if base.rows > rows:
        raise ValueError(f"base holds {base.rows} rows, the state {rows}")
    return tuple(base.segments), int(base.rows)


def immutable(array: np.ndarray) -> bool:
    """True when nothing can change `array`'s values and it holds no more memory than its
    own: read-only, and either owning its data or a view of a read-only array of as many
    bytes (numba's `copy_to_host` gives a view of a uint8 buffer; a read-only view of one lane of a 16-lane round is not: a payload keeping it would
    keep the whole round alive)."""
    if array.flags.writeable:
        return False
    base = array.base
    if base is None:
        return True
    return isinstance(base, np.ndarray) and not base.flags.writeable and base.nbytes == array.nbytes


def frozen_logits(logits: np.ndarray | None) -> np.ndarray | None:
    """A read-only copy of a state's last-row logits (None stays None); an `immutable` f32
    array is shared, not copied (the GPU backend's prefill logits: 1 MB at Qwen3.5's
    vocabulary, copied up to four times a first-token step before; bench/RESULTS.md,
    session 15)."""
    if logits is None:
        return None
    if logits.dtype == np.float32 and immutable(logits):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    out.flags.writeable = False
    return out


def rows_of(state: Any) -> int:
    """Row count a state or payload holds (both expose `.rows`)."""
    return int(state.rows)
