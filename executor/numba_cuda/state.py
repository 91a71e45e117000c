"""Per-stream device state: a pool of slots (fp32 recurrent matrices, bf16 conv tails,
bf16 K/V rows) and payloads that pack a state into exactly config.state_bytes(rows).

Kernels index the pool by slot, so one decode launch serves many streams. A payload is
one device byte buffer: per linear layer the recurrent matrix then the conv tail, then per
full-attention layer K rows [0, P) then V rows [0, P).
"""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda

from executor.config import Qwen35Config
from executor.numba_cuda.attention_mm import padded
from executor.numba_cuda.device import THREADS, blocks, empty, zeros
from executor.numba_cuda.launch import fast


@attrs.define(eq=False)
class DeviceState:
    """A live stream: its pool slot, the rows it holds, and the logits of row rows - 1
    (host float32) when the last call computed them."""

    slot: int
    rows: int = 0
    logits: np.ndarray | None = None
    released: bool = False


@attrs.frozen(eq=False)
class DevicePayload:
    """An immutable packed state on the device (`data` holds config.state_bytes(rows) bytes)."""

    rows: int
    data: object
    logits: np.ndarray | None


@fast
@cuda.jit
def _zero_kernel(flat):
    i = cuda.grid(1)
    if i < flat.shape[0]:
        flat[i] = 0


class StatePool:
    """Device arrays of `slots` streams of up to `capacity_rows` rows each.

    recurrent: f32 [linear_layers, slots, value_heads, key_dim, value_dim]
    conv: bf16 [linear_layers, slots, kernel - 1, conv_channels]
    keys, values: bf16 [full_layers, slots, padded(capacity_rows), kv_heads, head_dim],
    zeroed at start (attention_mm runs its GEMMs over whole 256-key tiles, reading rows past
    a chunk with zero weight: they must be finite, and they are, once zeroed or written)
    """

    def __init__(self, config: Qwen35Config, slots: int, capacity_rows: int) -> None:
        c = config
        self.config = c
        self.capacity_rows = capacity_rows
        lin, full = len(c.linear_layers), len(c.full_layers)
        vh, kd, vd = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.recurrent = zeros((lin, slots, vh, kd, vd), np.float32)
        self.conv = zeros((lin, slots, c.linear_conv_kernel_dim - 1, c.conv_channels), np.uint16)
        kv_shape = (full, slots, padded(capacity_rows), c.num_key_value_heads, c.head_dim)
        self.keys = empty(kv_shape, np.uint16)
        self.values = empty(kv_shape, np.uint16)
        for array in (self.keys, self.values):
            for layer in range(full):
                flat = array[layer].reshape(array[layer].size)
                _zero_kernel[blocks(flat.shape[0]), THREADS](flat)
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        """A free slot with zero recurrent matrices and conv tails. Raises RuntimeError when full."""
        if not self._free:
            raise RuntimeError("the state pool is full: release a state first")
        slot = self._free.pop()
        for i in range(self.recurrent.shape[0]):
            for array in (self.recurrent[i, slot], self.conv[i, slot]):
                flat = array.reshape(array.size).view(np.uint16)
                _zero_kernel[blocks(flat.shape[0]), THREADS](flat)
        return slot

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def _parts(self, slot: int, rows: int):
        """(device view, byte count) of each packed part, in payload order."""
        for i in range(self.recurrent.shape[0]):
            yield self.recurrent[i, slot]
            yield self.conv[i, slot]
        for j in range(self.keys.shape[0]):
            yield self.keys[j, slot, :rows]
            yield self.values[j, slot, :rows]

    def pack(self, slot: int, rows: int):
        """A new device byte buffer holding the state of `slot` at `rows` rows."""
        data = empty((self.config.state_bytes(rows),), np.uint8)
        offset = 0
        for part in self._parts(slot, rows):
            n = part.size * part.dtype.itemsize
            if n:
                data[offset : offset + n].view(part.dtype).reshape(part.shape).copy_to_device(part)
            offset += n
        assert offset == data.shape[0], (offset, data.shape[0])
        return data

    def unpack(self, data, slot: int, rows: int) -> None:
        """Write a packed state into `slot`."""
        offset = 0
        for part in self._parts(slot, rows):
            n = part.size * part.dtype.itemsize
            if n:
                part.copy_to_device(data[offset : offset + n].view(part.dtype).reshape(part.shape))
            offset += n
        assert offset == data.shape[0], (offset, data.shape[0])
