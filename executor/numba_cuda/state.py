"""Per-stream device state: a pool of slots (fp32 recurrent matrices, bf16 conv tails,
bf16 K/V rows) and payloads that pack a state in the serving format (config.state_bytes).

Kernels index the pool by slot, so one decode launch serves many streams. A kept state is
a `DevicePayload`: its *fixed part* (one byte buffer: every linear layer's recurrent matrix,
then every linear layer's conv tail) and the K/V rows [0, rows) as a chain of `KVSegment`s,
root first. A payload copies only the segment above the payload it builds on (its *base*:
the nearest kept prefix, `policy.store.Store.keep_copy`) and shares the base's segments, so
device memory is what the store counts (DESIGN rule 3: K/V rows shared with a kept prefix
are not held twice). A ghost payload (`NumbaCudaBackend.ghost`) drops the fixed part and keeps
its segments for the longer states built on it.

Each part is one strided copy launch (the fixed part 1, each segment 1 for its K and V), not
one copy per layer and part (128 at 27B, each tens of microseconds of host time: a keep after
every chunk made the server's short chunks ~2x slower than the same chunk alone;
bench/RESULTS.md, session 3). A restore launches 1 + one per segment.
"""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda

from executor.config import Qwen35Config
from executor.numba_cuda.attention_mm import padded
from executor.numba_cuda.device import THREADS, LeanArray, blocks, empty, lasting, using_pool, zeros
from executor.numba_cuda.launch import fast


@attrs.define(eq=False)
class DeviceState:
    """A live stream: its pool slot, the rows it holds, the logits of row rows - 1 (host
    float32) when the last call computed them, and `greedy`: their argmax as the device
    computed it (`greedy.argmax_rows`, equal to np.argmax of `logits`), or None (restored
    logits, or none)."""

    slot: int
    rows: int = 0
    logits: np.ndarray | None = None
    released: bool = False
    greedy: int | None = None


@attrs.frozen(eq=False)
class KVSegment:
    """K/V rows [start, end) of every full-attention layer on the device: `data` is bf16 bits
    uint16 [2 (keys, values), full_layers, (end - start) * kv_heads * head_dim]."""

    start: int
    end: int
    data: object

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0] * self.data.shape[1] * self.data.shape[2] * 2)


@attrs.frozen(eq=False)
class DevicePayload:
    """An immutable kept state on the device.

    rows: rows [0, rows) it holds. fixed: uint8 [config.fixed_state_bytes] (recurrent matrices,
    then conv tails), None for a ghost (not restorable; a base for longer payloads).
    segments: K/V rows [0, rows) as `KVSegment`s, contiguous and ascending; all but the last
    may be shared with other payloads. logits: float32 [vocab] of row rows - 1, or None.
    """

    rows: int
    fixed: object | None
    segments: tuple[KVSegment, ...]
    logits: np.ndarray | None

    @property
    def kv_from(self) -> int:
        """First row of the K/V rows this payload holds itself (its last segment when that
        ends at `rows`; `rows` when it holds none)."""
        last = self.segments[-1] if self.segments else None
        return last.start if last is not None and last.end == self.rows else self.rows


@fast
@cuda.jit
def _zero_kernel(flat):
    i = cuda.grid(1)
    if i < flat.shape[0]:
        flat[i] = 0


@fast
@cuda.jit
def _copy_rows_kernel(src, dst):
    # src, dst: [n, m] of one dtype, any strides: dst[i, j] = src[i, j] (row i per blockIdx.y)
    i = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while j < src.shape[1]:
        dst[i, j] = src[i, j]
        j += step


@fast
@cuda.jit
def _zero_rows_kernel(dst):
    # dst: [n, m], any strides: dst[i, j] = 0
    i = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while j < dst.shape[1]:
        dst[i, j] = 0
        j += step


MAX_COPY_BLOCKS = 512
"""Blocks per row of a strided copy (each loops over the rest of its row)."""


def _grid(array) -> tuple[int, int]:
    return (min(blocks(array.shape[1]), MAX_COPY_BLOCKS), array.shape[0])


@fast
@cuda.jit
def _copy_pair_kernel(src_a, dst_a, src_b, dst_b):
    # dst_a[i, j] = src_a[i, j] for blockIdx.z == 0, else dst_b[i, j] = src_b[i, j]; the pairs
    # may differ in shape and dtype (rows past a pair's own are skipped)
    i = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    if cuda.blockIdx.z == 0:
        if i < src_a.shape[0]:
            while j < src_a.shape[1]:
                dst_a[i, j] = src_a[i, j]
                j += step
    elif i < src_b.shape[0]:
        while j < src_b.shape[1]:
            dst_b[i, j] = src_b[i, j]
            j += step


def _copy_pair(src_a, dst_a, src_b, dst_b) -> None:
    """copy_rows(src_a, dst_a) and copy_rows(src_b, dst_b) in one launch. Each pair is one
    shape and one dtype; the two pairs may differ (the fixed part's f32 recurrent matrices
    and bf16 conv tails go together). Raises ValueError for a mismatched pair."""
    for src, dst in ((src_a, dst_a), (src_b, dst_b)):
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(f"pair copy of mismatched arrays {src.shape} {src.dtype} and {dst.shape} {dst.dtype}")
    if src_a.size or src_b.size:
        x = max(_grid(src_a)[0], _grid(src_b)[0])
        _copy_pair_kernel[(x, max(src_a.shape[0], src_b.shape[0]), 2), THREADS](src_a, dst_a, src_b, dst_b)


def copy_rows(src, dst) -> None:
    """dst[:] = src for two [n, m] device arrays of one dtype (any strides), in one launch."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy of {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
    if src.size:
        _copy_rows_kernel[_grid(src), THREADS](src, dst)


class StatePool:
    """Device arrays of `slots` streams of up to `capacity_rows` rows each.

    recurrent: f32 [linear_layers, slots, value_heads, key_dim, value_dim]
    conv: bf16 [linear_layers, slots, kernel - 1, conv_channels]
    keys, values: bf16 [full_layers, slots, padded(capacity_rows), kv_heads, head_dim],
    zeroed at start (attention_mm runs its GEMMs over whole 256-key tiles and the fused
    attention_flash reads whole 32-key blocks, both reading rows past a chunk with zero
    weight: they must be finite, and they are, once zeroed or written)
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
        self.keys = lasting(kv_shape, np.uint16)  # exact bytes: a pool block would round 18 GiB up to 20
        self.values = lasting(kv_shape, np.uint16)
        for array in (self.keys, self.values):
            for layer in range(full):
                flat = array[layer].reshape(array[layer].size)
                _zero_kernel[blocks(flat.shape[0]), THREADS](flat)
        self._free = list(range(slots - 1, -1, -1))
        self.memory = None
        """Where payload buffers come from: a `cache_memory.CacheMemory` once the backend's
        `reserve_cache` set one, else `device.empty`'s pool."""
        # [layers, slots, elements per slot] views of the same memory (a slot is one strided row set)
        self._recurrent3 = self.recurrent.reshape(lin, slots, vh * kd * vd)
        self._conv3 = self.conv.reshape(lin, slots, (c.linear_conv_kernel_dim - 1) * c.conv_channels)
        row_elems = c.num_key_value_heads * c.head_dim
        self._row_elems = row_elems
        self._keys3 = self.keys.reshape(full, slots, padded(capacity_rows) * row_elems)
        self._values3 = self.values.reshape(full, slots, padded(capacity_rows) * row_elems)
        self._slot_fixed: dict[int, tuple] = {}  # slot -> its fixed part's pool views (`_fixed_views`)

    def take(self, zero: bool = True) -> int:
        """A free slot, with zero recurrent matrices and conv tails unless `zero` is False (a
        restore overwrites them). Raises RuntimeError when full."""
        if not self._free:
            raise RuntimeError("the state pool is full: release a state first")
        slot = self._free.pop()
        if zero:
            for array in (self._recurrent3[:, slot], self._conv3[:, slot]):
                if array.size:
                    _zero_rows_kernel[_grid(array), THREADS](array)
        return slot

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def _parts(self, slot: int, rows: int):
        """(pool view [n, m], dtype) of each packed part, in payload order."""
        n = rows * self._row_elems
        yield self._recurrent3[:, slot], np.float32
        yield self._conv3[:, slot], np.uint16
        yield self._keys3[:, slot, :n], np.uint16
        yield self._values3[:, slot, :n], np.uint16

    def _payload_views(self, data, slot: int, rows: int):
        """(pool view, payload view) pairs of the same shape, in payload order. Raises
        ValueError when `data` does not hold config.state_bytes(rows) bytes."""
        if data.shape[0] != self.config.state_bytes(rows):
            raise ValueError(f"a payload of {data.shape[0]} bytes for a state of {self.config.state_bytes(rows)} bytes")
        offset = 0
        for part, dtype in self._parts(slot, rows):
            n = part.shape[0] * part.shape[1] * np.dtype(dtype).itemsize
            if n:
                yield part, data[offset : offset + n].view(dtype).reshape(part.shape)
            offset += n
        assert offset == data.shape[0], (offset, data.shape[0])

    def pack_fixed(self, slot: int):
        """A new device uint8 buffer [config.fixed_state_bytes]: the recurrent matrices then the
        conv tails of `slot` (1 launch)."""
        data = self._payload_buffer((self.config.fixed_state_bytes,), np.uint8)
        (rec, rec_view), (conv, conv_view) = self._fixed_views(data, slot)
        _copy_pair(rec, rec_view, conv, conv_view)
        return data

    def unpack_fixed(self, data, slot: int) -> None:
        """Write a fixed part (`pack_fixed`) into `slot` (1 launch). Raises ValueError on a
        buffer of the wrong size."""
        if data.shape[0] != self.config.fixed_state_bytes:
            raise ValueError(f"a fixed part of {data.shape[0]} bytes for {self.config.fixed_state_bytes}")
        (rec, rec_view), (conv, conv_view) = self._fixed_views(data, slot)
        _copy_pair(rec_view, rec, conv_view, conv)

    def _payload_buffer(self, shape: tuple, dtype):
        if self.memory is None:
            return empty(shape, dtype)
        with using_pool(self.memory):
            return empty(shape, dtype)

    def _fixed_views(self, data, slot: int):
        """((pool recurrent [lin, m], payload view), (pool conv [lin, m'], payload view)) of a
        fixed part `data` (uint8, C-contiguous) and `slot`. The pool's views are made once a
        slot; a LeanArray payload's are built at their offsets directly (on the H200 host a
        restore spent ~150 us making these views with slices, views and reshapes after an idle
        spell, bench/RESULTS.md session 22)."""
        parts = self._slot_fixed.get(slot)
        if parts is None:
            parts = self._slot_fixed[slot] = tuple(
                (part, np.dtype(dtype)) for part, dtype in ((self._recurrent3[:, slot], np.float32),
                                                             (self._conv3[:, slot], np.uint16)))
        offset, out = 0, []
        for part, dtype in parts:
            n = part.shape[0] * part.shape[1] * dtype.itemsize
            if not n:
                view = part  # nothing to copy
            elif isinstance(data, LeanArray) and data.is_c_contiguous():
                view = data.at(offset, part.shape, dtype)
            else:
                view = data[offset : offset + n].view(dtype).reshape(part.shape)
            out.append((part, view))
            offset += n
        return out

    def _row_views(self, slot: int, start: int, end: int):
        a, b = start * self._row_elems, end * self._row_elems
        return self._keys3[:, slot, a:b], self._values3[:, slot, a:b]

    def pack_rows(self, slot: int, start: int, end: int) -> KVSegment:
        """A new segment holding the K/V rows [start, end) of `slot` (1 launch). Raises
        ValueError unless 0 <= start < end <= capacity_rows."""
        if not 0 <= start < end <= self.capacity_rows:
            raise ValueError(f"K/V rows [{start}, {end}) outside [0, {self.capacity_rows})")
        keys, values = self._row_views(slot, start, end)
        data = self._payload_buffer((2,) + tuple(keys.shape), np.uint16)
        _copy_pair(keys, data[0], values, data[1])
        return KVSegment(start, end, data)

    def unpack_rows(self, segment: KVSegment, slot: int) -> None:
        """Write a segment's K/V rows into `slot` (1 launch)."""
        if not 0 <= segment.start < segment.end <= self.capacity_rows:
            raise ValueError(f"K/V rows [{segment.start}, {segment.end}) outside [0, {self.capacity_rows})")
        keys, values = self._row_views(slot, segment.start, segment.end)
        _copy_pair(segment.data[0], keys, segment.data[1], values)

    def pack(self, slot: int, rows: int):
        """A new device byte buffer holding the state of `slot` at `rows` rows (4 launches)."""
        data = empty((self.config.state_bytes(rows),), np.uint8)
        for part, view in self._payload_views(data, slot, rows):
            copy_rows(part, view)
        return data

    def unpack(self, data, slot: int, rows: int) -> None:
        """Write a packed state into `slot` (4 launches)."""
        for part, view in self._payload_views(data, slot, rows):
            copy_rows(view, part)
