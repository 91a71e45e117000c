"""The one device-allocation helper, bf16 bit conversions on the device, and launch sizes.

Every buffer a kernel writes is allocated by `empty`, so tests can poison new buffers
(`poisoned()`: NaN for floats, a bf16 NaN pattern for uint16, -1 for ints) and catch
outputs a kernel never wrote, and so a CUDA graph capture takes one step's buffers from a
private pool (`using_pool`). Arrays that live as long as the backend (weights, the state
pool) come from `lasting`, in their exact sizes. bf16 values live in uint16 arrays (their bit pattern), as in
`executor/safetensors_file.py`. Nothing here computes model math.

On a GPU the backend's arrays are `LeanArray`s (pointer, shape, strides, dtype): `empty`
hands them out from `DevicePool` (its own cuMemAlloc blocks), `to_device` and `zeros` wrap
numba's arrays in them. Building one costs about a microsecond where a numba array or view
cost 14-36 us of host time, which made short prefill chunks host-bound (bench/RESULTS.md,
session 6). Under the CUDA simulator everything stays numba's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import os
import threading

import numpy as np
from numba import cuda

IS_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
"""True when numba.cuda is the CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before import)."""

if not IS_SIMULATOR:  # ColumnSlicer builds arrays on it (the simulator has none)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

THREADS = 128
"""Threads per block of every kernel here (a multiple of the warp, a power of two)."""

BF16_POISON = np.uint16(0xFFC1)
"""A bf16 NaN bit pattern written into poisoned uint16 buffers."""

_poison: contextvars.ContextVar[bool] = contextvars.ContextVar("warmstate_poison_alloc", default=False)


@contextlib.contextmanager
def poisoned():
    """Within this block, `empty` fills each new buffer with a poison value."""
    token = _poison.set(True)
    try:
        yield
    finally:
        _poison.reset(token)


def _poison_value(dtype: np.dtype):
    if dtype.kind == "f":
        return np.nan
    if dtype == np.uint16:
        return BF16_POISON
    if dtype.kind in "iu":
        return np.iinfo(dtype).max if dtype.kind == "u" else -1
    raise ValueError(f"no poison value for dtype {dtype}")


_pool: contextvars.ContextVar["DevicePool | None"] = contextvars.ContextVar("warmstate_pool", default=None)


@contextlib.contextmanager
def using_pool(pool: "DevicePool"):
    """Within this block `empty` takes its blocks from `pool` instead of the process's `POOL`
    (graphs.PrefillGraphs: a private pool whose blocks only its captured steps use)."""
    token = _pool.set(pool)
    try:
        yield pool
    finally:
        _pool.reset(token)


def _size_class(nbytes: int) -> int:
    """Bytes of the pool block that serves `nbytes`: 512-byte steps up to 64 KiB, then
    quarter steps between powers of two (at most 25% of a block unused)."""
    if nbytes <= 1 << 16:
        return -(-nbytes // 512) * 512
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


def _numba_pointer(array) -> int:
    """The device address of a numba device array's first element."""
    ptr = getattr(array, "ptr", None)
    if ptr is None:
        return int(array.__cuda_array_interface__["data"][0])
    return int(ptr)


EMPTY_LAYOUT = "empty"
"""The layout part of an empty array's launch key (`LeanArray.launch_key`, `launch._arg_key`):
no numba type has it, so a launch with an empty array argument fails the first-launch check
and runs through numba, under a key of its own, whatever rule this numba-cuda types empty
arrays by (numba-cuda 0.30 and the numba CPU installs carry disagree on a zero stride), and
no signature of non-empty arrays ever takes that path because of it."""


def layout_of(shape: tuple, strides: tuple, itemsize: int) -> str:
    """numba's array layout letter ("C", "F" or "A") for these shape, strides (bytes) and
    itemsize: numba-cuda's `DeviceNDArray._numba_type_` over dummyarray's contiguity flags
    (which follow NumPy's _UpdateContiguousFlags: axes of length 1 are skipped, an empty
    array is contiguous, a zero stride is a broadcast)."""
    size = math.prod(shape)
    if not shape or size == 0:
        return "C"
    if 0 in strides:
        return "A"
    c_contig = f_contig = True
    sd = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1:
            if stride != sd:
                c_contig = False
            sd *= dim
    sd = itemsize
    for dim, stride in zip(shape, strides):
        if dim != 1:
            if stride != sd:
                f_contig = False
                break
            sd *= dim
    return "C" if c_contig else "F" if f_contig else "A"


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class LeanArray:
    """A device array as plain numbers: data pointer, shape, strides (bytes), dtype, and an
    owner that keeps the memory alive (a pooled block's lease, or the numba array it wraps).

    Why: each numba `DeviceNDArray` (and each slice or reshape of one) builds a dummyarray,
    MemoryPointer objects and weakref finalizers: ~14 us a pooled allocation and ~36 us a
    row slice on the H200 host, ~1,000 allocations and ~250 views per 27B prefill chunk, so
    a short chunk spent more host time on array objects than the GPU spent on the chunk
    (bench/RESULTS.md, session 6). A LeanArray is built in about a microsecond; kernels take
    it through `launch.fast` (which packs these fields as numba would, and checks the bytes
    against numba's own on the first launch of each signature), cuBLASLt through `ptr`.

    Supported here without numba: `shape`, `strides`, `dtype`, `size`, `ndim`, `nbytes`,
    `ptr`, basic indexing with integers and step-1 slices (`a[i]`, `a[lo:hi]`,
    `a[:, lo:hi]`, `a[:, i, :n]`), `reshape` of a C-contiguous array, `view(dtype)` of an
    array contiguous in its last axis, `is_c_contiguous()`, `__cuda_array_interface__`
    (version 3, no stream). Everything else (copies to and from the host, other indexing)
    goes through `to_numba()`, a numba view of the same memory (made once, then kept).
    `launch_key`: (dtype, ndim, layout), the numba type's parts that pick a compiled kernel
    (layout EMPTY_LAYOUT for an empty array).
    """

    __slots__ = ("_numba", "_owner", "dtype", "launch_key", "ndim", "ptr", "shape", "size", "strides")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype, owner) -> None:
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        strides = tuple(int(s) for s in strides)
        if len(shape) != len(strides):
            raise ValueError(f"shape {shape} and strides {strides} differ in length")
        self._set(int(ptr), shape, strides, dtype, owner, layout_of(shape, strides, dtype.itemsize))

    def _set(self, ptr, shape, strides, dtype, owner, layout) -> None:
        self.ptr, self.shape, self.strides, self.dtype, self._owner = ptr, shape, strides, dtype, owner
        self.ndim = len(shape)
        self.size = math.prod(shape)
        self.launch_key = (dtype, self.ndim, layout if self.size else EMPTY_LAYOUT)
        self._numba = None

    @classmethod
    def c_contiguous(cls, ptr: int, shape: tuple, dtype: np.dtype, owner) -> "LeanArray":
        """A C-contiguous array of `shape` at `ptr` (shape: a tuple of ints)."""
        array = cls.__new__(cls)
        array._set(ptr, shape, _c_strides(shape, dtype.itemsize), dtype, owner, "C")
        return array

    @classmethod
    def wrap(cls, array) -> "LeanArray":
        """A LeanArray over a numba device array's memory (which it keeps alive)."""
        if isinstance(array, LeanArray):
            return array
        return cls(_numba_pointer(array) if array.size else 0, array.shape, array.strides, array.dtype, array)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LeanArray(ptr=0x{self.ptr:x}, shape={self.shape}, strides={self.strides}, dtype={self.dtype})"

    def is_c_contiguous(self) -> bool:
        return self.launch_key[2] == "C"

    @property
    def __cuda_array_interface__(self) -> dict:
        # strides None only for the standard C strides: a C-contiguous view may carry another
        # stride on an axis of length 1, and numba's view must keep it (launch.py compares bytes)
        standard = self.strides == _c_strides(self.shape, self.dtype.itemsize)
        return {"shape": self.shape, "strides": None if standard else self.strides, "data": (self.ptr, False),
                "typestr": self.dtype.str, "stream": None, "version": 3}

    def to_numba(self):
        """A numba DeviceNDArray view of this memory (kept, so made once)."""
        if self._numba is None:
            if self.size == 0:
                self._numba = cuda.device_array(self.shape, self.dtype)
            else:
                from numba.cuda.api import from_cuda_array_interface

                self._numba = from_cuda_array_interface(self.__cuda_array_interface__, owner=self._owner, sync=False)
        return self._numba

    def __getattr__(self, name):  # copy_to_host, copy_to_device, gpu_data, ...: numba's, on the same memory
        if name.startswith("__") or name in LeanArray.__slots__:
            raise AttributeError(name)
        return getattr(self.to_numba(), name)

    def copy_to_device(self, ary, stream=0) -> None:
        """Copy a host array or a device array (LeanArray or numba's) into this one."""
        self.to_numba().copy_to_device(ary.to_numba() if isinstance(ary, LeanArray) else ary, stream=stream)

    def __getitem__(self, key):
        items = key if isinstance(key, tuple) else (key,)
        if len(items) > self.ndim:
            raise IndexError(f"{len(items)} indices for a {self.ndim}-d array")
        ptr, shape, strides = self.ptr, [], []
        for axis, item in enumerate(items):
            dim, stride = self.shape[axis], self.strides[axis]
            if isinstance(item, slice):
                if item.step not in (None, 1):
                    return self.to_numba()[key]
                lo, hi, _ = item.indices(dim)
                n = max(0, hi - lo)
                ptr += lo * stride if n else 0
                shape.append(n)
                strides.append(stride)
            elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
                i = int(item)
                if not -dim <= i < dim:
                    raise IndexError(f"index {i} is out of bounds for axis {axis} with size {dim}")
                ptr += (i % dim) * stride
            else:
                return self.to_numba()[key]
        shape += self.shape[len(items):]
        strides += self.strides[len(items):]
        view = LeanArray.__new__(LeanArray)
        view._set(ptr, tuple(shape), tuple(strides), self.dtype, self._owner,
                  layout_of(shape, strides, self.dtype.itemsize))
        return view

    def reshape(self, *shape) -> "LeanArray":
        """The same memory in another C-order shape (this array must be C-contiguous)."""
        shape = tuple(int(d) for d in (shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape))
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape an array of size {self.size} into shape {shape}")
        if not self.is_c_contiguous():
            return LeanArray.wrap(self.to_numba().reshape(*shape))
        return LeanArray.c_contiguous(self.ptr, shape, self.dtype, self._owner)

    def at(self, offset: int, shape: tuple, dtype) -> "LeanArray":
        """A C-contiguous `shape` array of `dtype` starting `offset` bytes into this one (which
        must be C-contiguous and hold it): one object, not a slice, view and reshape. Raises
        ValueError when it does not fit, this array is not C-contiguous, a dimension is
        negative or the offset is not a multiple of dtype's size; TypeError for a non-integer
        dimension."""
        dtype = np.dtype(dtype)
        dims = tuple(operator.index(d) for d in shape)  # TypeError for a float dimension
        if any(d < 0 for d in dims):
            raise ValueError(f"shape {dims} has a negative dimension")
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        nbytes, held = math.prod(dims) * dtype.itemsize, self.size * self.dtype.itemsize
        if not self.is_c_contiguous() or offset < 0 or offset + nbytes > held:
            raise ValueError(f"{nbytes} bytes at offset {offset} do not fit a C-contiguous {held}-byte array")
        return LeanArray.c_contiguous(self.ptr + offset, dims, dtype, self._owner)

    def view(self, dtype) -> "LeanArray":
        """The same memory as another dtype; the last axis (contiguous) rescales."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        if not self.shape or (self.shape[-1] > 1 and self.strides[-1] != self.dtype.itemsize):
            raise ValueError("view(dtype) needs an array contiguous in its last axis")
        last = self.shape[-1] * self.dtype.itemsize
        if last % dtype.itemsize:
            raise ValueError(f"the last axis ({last} bytes) is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        shape = self.shape[:-1] + (last // dtype.itemsize,)
        strides = self.strides[:-1] + (dtype.itemsize,)
        return LeanArray(self.ptr, shape, strides, dtype, self._owner)


class _Lease:
    """A pooled block in use: back to its pool when the last array or view on it is gone
    (CPython frees it at once: arrays and views hold it, nothing refers back)."""

    __slots__ = ("pool", "ptr", "size")

    def __init__(self, pool: "DevicePool", size: int, ptr: int) -> None:
        self.pool, self.size, self.ptr = pool, size, ptr

    def __del__(self) -> None:
        try:
            self.pool._give(self.size, self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the memory goes with the process
            pass


class DevicePool:
    """A stream-ordered cache of device memory behind `empty` (as PyTorch's caching
    allocator): an array's block goes back to the pool when the array and every view of
    it are gone, and the next `empty` of that size class reuses it at once. Safe because
    every launch here is ordered after the earlier ones (one stream, or blocking streams
    with the legacy default stream), so work queued on the old array runs first.

    Why: numba allocates each array with cuMemAlloc and frees in batches of ten with
    cuMemFree, which waits for the device, so a prefill chunk of a few rows (hundreds of
    small buffers) was bound by allocation round trips, not by its kernels. Arrays are
    `LeanArray`s: no numba objects or weakref finalizers per allocation (those cost ~14 us
    an allocation, ~1000 allocations per 27B prefill chunk: bench/RESULTS.md, session 6).
    Blocks are the pool's own cuMemAlloc allocations (numba's memory manager never sees
    them, so nothing but the pool frees them). Free blocks are kept up to `limit_bytes`;
    a block returned past it is retired, and retired blocks are freed (after a device
    synchronize, since cuMemFree must not race queued work) at the next allocation that
    misses the cache, or by `release`. On an allocation failure every cached and retired
    block is freed (and `on_oom` run) and the allocation tried once more, unless `release_on_oom` is False
    (graphs.PrefillGraphs' private pool: its cached blocks are buffers that captured graphs
    still use, so a failure raises instead). The process's `POOL` is enabled unless
    WARMSTATE_DEVICE_POOL=0; the simulator never pools.
    """

    def __init__(self, limit_bytes: int, release_on_oom: bool = True) -> None:
        self.limit_bytes = limit_bytes
        self.release_on_oom = release_on_oom
        self.on_oom: list = []
        """Callables that give other pools' unused memory back before the retry after an
        allocation failure (`cache_memory.CacheMemory.trim`)."""
        self.cached_bytes = 0
        self.live_bytes = 0
        """Bytes of the blocks handed out and not yet given back (size classes, not requests)."""
        self.peak_bytes = 0
        """The most `live_bytes` since the pool was made or `reset_peak` ran."""
        self.hits = self.misses = 0
        self._free: dict[int, list[int]] = {}
        self._retired: list[int] = []
        self._lock = threading.RLock()  # RLock: a lease may die inside a locked section

    def _block(self, size: int) -> int:
        from numba.cuda.cudadrv.driver import driver

        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                self.cached_bytes -= size
                self.hits += 1
                self._lease(size)
                return blocks.pop()
            self.misses += 1
            retired, self._retired = self._retired, []
        cuda.current_context()  # numba's context is current on this thread
        if retired:
            cuda.synchronize()
            for ptr in retired:
                driver.cuMemFree(ptr)
        try:
            ptr = int(driver.cuMemAlloc(size))
        except Exception:  # noqa: BLE001 - out of memory: give the cached blocks back and retry once
            if not self.release_on_oom:
                raise
            self.release()
            for give_back in self.on_oom:
                give_back()
            ptr = int(driver.cuMemAlloc(size))
        with self._lock:
            self._lease(size)
        return ptr

    def _lease(self, size: int) -> None:  # under the lock
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        """Start `peak_bytes` again from the bytes live now."""
        with self._lock:
            self.peak_bytes = self.live_bytes

    def _give(self, size: int, ptr: int) -> None:
        with self._lock:
            self.live_bytes -= size
            if self.cached_bytes + size <= self.limit_bytes:
                self._free.setdefault(size, []).append(ptr)
                self.cached_bytes += size
            else:
                self._retired.append(ptr)

    def release(self) -> None:
        """Free every cached and retired block now (after the device finishes its work).

        The lists are swapped for fresh empty ones under the lock and freed from the
        detached ones, so a lease that dies meanwhile on this thread (a garbage collection;
        the RLock lets its `_give` in) gives its block to the fresh lists, where it stays
        cached until the next call, and never changes the lists being freed."""
        from numba.cuda.cudadrv.driver import driver

        with self._lock:
            free, retired = self._free, self._retired
            self._free, self._retired, self.cached_bytes = {}, [], 0
        if IS_SIMULATOR:  # nothing allocated, and its context has no deallocation queue
            return
        cuda.synchronize()
        for ptrs in (retired, *free.values()):
            for ptr in ptrs:
                driver.cuMemFree(ptr)
        cuda.current_context().deallocations.clear()

    def array(self, shape: tuple, dtype: np.dtype, stream=0) -> "LeanArray":
        """A C-contiguous `LeanArray` of `shape` (all entries > 0) and `dtype` on a pooled block."""
        nbytes = math.prod(shape) * dtype.itemsize
        size = _size_class(nbytes)
        ptr = self._block(size)
        return LeanArray.c_contiguous(ptr, shape, dtype, _Lease(self, size, ptr))


POOL = None if IS_SIMULATOR or os.environ.get("WARMSTATE_DEVICE_POOL", "1") == "0" else DevicePool(
    int(float(os.environ.get("WARMSTATE_DEVICE_POOL_GIB", "16")) * (1 << 30)))
"""The process's device pool (None: plain numba allocations)."""


def empty(shape, dtype, stream=0):
    """A new device array (uninitialised; poisoned inside `poisoned()`; a `LeanArray` from the
    pool of `using_pool`, else from `POOL` when it is on)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in (shape if isinstance(shape, tuple) else (shape,)))
    pool = _pool.get() or POOL
    if pool is not None and all(shape):
        array = pool.array(shape, dtype, stream)
    else:
        array = cuda.device_array(shape, dtype=dtype, stream=stream)
    if _poison.get() and array.size:
        array.copy_to_device(np.full(array.shape, _poison_value(dtype), dtype=dtype), stream=stream)
    return array


class ColumnSlicer:
    """`array[:, lo:hi]` of a C-contiguous 2-D device array in constant host time.

    numba slices a non-contiguous view by walking every row of it in Python
    (`dummyarray.iter_contiguous_extent`): about a microsecond a row, so the four column
    slices of each linear-attention layer cost ~0.8 s of host time per 4096-row 27B chunk.
    This builds the same view (the byte range from the first row's `lo` to the last row's
    `hi`, the parent's strides) directly. The first call on a real GPU checks the result
    against numba's own slice (pointer, shape, strides); on a mismatch or an error it falls
    back to numba's slicing for good. The simulator always slices through numba.
    """

    def __init__(self) -> None:
        self.fast: bool | None = None if not IS_SIMULATOR else False

    def _view(self, array, lo: int, hi: int):
        rows, cols = array.shape
        item = array.dtype.itemsize
        data = array.gpu_data.view(lo * item, ((rows - 1) * cols + hi) * item)
        return DeviceNDArray(shape=(rows, hi - lo), strides=array.strides, dtype=array.dtype, gpu_data=data)

    def __call__(self, array, lo: int, hi: int):
        if isinstance(array, LeanArray):
            return array[:, lo:hi]
        rows, cols = array.shape
        if self.fast is False or rows < 2 or not 0 <= lo < hi <= cols or not array.is_c_contiguous():
            return array[:, lo:hi]
        if self.fast is None:
            expected = array[:, lo:hi]
            try:
                view = self._view(array, lo, hi)
                got, want = view.__cuda_array_interface__, expected.__cuda_array_interface__
                self.fast = all(got[k] == want[k] for k in ("shape", "strides", "data", "typestr"))
            except Exception:  # noqa: BLE001 - another numba: keep its slicing
                self.fast = False
            return expected
        return self._view(array, lo, hi)


columns = ColumnSlicer()
"""The process's column slicer (`ColumnSlicer`)."""


def device_pointer(array) -> int:
    """The device address of an array's first element (numba-cuda's `ptr` attribute when it
    has one: building `__cuda_array_interface__` costs microseconds on every GEMM)."""
    ptr = getattr(array, "ptr", None)
    if ptr is None:
        return int(array.__cuda_array_interface__["data"][0])
    return int(ptr)


def zeros(shape, dtype, stream=0):
    """A new device array of zeros (state buffers start at zero by definition); a
    `LeanArray` on a GPU, numba's array under the simulator."""
    array = cuda.device_array(shape, dtype=np.dtype(dtype), stream=stream)
    if array.size:
        array.copy_to_device(np.zeros(array.shape, dtype=dtype), stream=stream)
    return array if IS_SIMULATOR else LeanArray.wrap(array)


def lasting(shape, dtype, stream=0):
    """A new uninitialised device array of exactly its bytes, outside every pool: for arrays
    that live as long as the backend (weights, the state pool). `empty`'s size classes round
    a block up by up to 25%, 6.2 GiB over the 27B's 50.1 GiB of random weights (sessions
    12-14 took them from the pool; bench/RESULTS.md session 15). A `LeanArray` on a GPU,
    numba's array under the simulator."""
    array = cuda.device_array(tuple(shape) if isinstance(shape, tuple) else (shape,), dtype=np.dtype(dtype),
                              stream=stream)
    return array if IS_SIMULATOR else LeanArray.wrap(array)


def copy_of(array, stream=0):
    """A fresh (256-byte aligned, C-contiguous) device copy of a device array, from `empty`
    (cuBLAS inputs, timing copies of a weight)."""
    out = empty(tuple(array.shape), array.dtype, stream)
    out.copy_to_device(array, stream=stream)
    return out


def to_device(host: np.ndarray, stream=0):
    """Copy a host array into a new (contiguous) device array; a `LeanArray` on a GPU,
    numba's array under the simulator."""
    array = cuda.to_device(np.ascontiguousarray(host), stream=stream)
    return array if IS_SIMULATOR else LeanArray.wrap(array)


def chunk_meta(meta, rows: int, start: int, slot: int, stream=0):
    """The i32 device array [>= 3] = (rows in use, start row, slot) that a prefill kernel reads
    on the device (graphs.PrefillGraphs replays a captured chunk with other values): `meta`
    itself when given (checked: i32, 1-D, at least 3 entries; its values live on the device),
    else a new upload of (rows, start, slot). Raises ValueError naming `meta`."""
    if meta is None:
        return to_device(np.asarray([rows, start, slot], np.int32), stream)
    check("meta", meta, np.int32, 1)
    if meta.shape[0] < 3:
        raise ValueError(f"meta {tuple(meta.shape)} must hold (rows, start, slot)")
    return meta


def is_gpu_available() -> bool:
    """A real CUDA GPU is usable (False under the simulator)."""
    return not IS_SIMULATOR and cuda.is_available()


def blocks(n: int, per_block: int = THREADS) -> int:
    """Blocks needed to cover n items, at least 1."""
    return max(1, (n + per_block - 1) // per_block)


def check(name: str, array, dtype, ndim: int, inner_contiguous: bool = True) -> None:
    """Raise ValueError naming the argument when its dtype, rank or layout is off."""
    if array.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {array.shape}")
    shape, strides = tuple(array.shape), tuple(array.strides)
    if inner_contiguous and shape[-1] > 1 and strides[-1] != array.dtype.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {array.strides}")


def check_product(x, w, w_name: str = "w") -> tuple[int, int, int]:
    """(M, N, K) of a product x @ w.T of bf16 (uint16) device arrays x [M, K] and w [N, K];
    raises ValueError naming the argument when a dtype, rank or layout is off or the K differ."""
    check("x", x, np.uint16, 2)
    check(w_name, w, np.uint16, 2)
    m, k = x.shape
    if w.shape[1] != k:
        raise ValueError(f"{w_name} has {w.shape[1]} columns, x has {k}")
    return m, w.shape[0], k


if IS_SIMULATOR:

    def bf16_to_f32(bits):
        """bf16 bits (uint16) to float32, exactly."""
        return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)

    def f32_to_bf16(x):
        """float32 to bf16 bits, round to nearest even (NaN stays NaN)."""
        u = int(np.float32(x).view(np.uint32))
        if x != x:
            return np.uint16((u >> 16) | 0x40)
        return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)

    def round_bf16(x):
        """bf16_to_f32(f32_to_bf16(x)) (the same bits); on a GPU in 32-bit integer arithmetic."""
        return bf16_to_f32(f32_to_bf16(x))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(bits):
        """bf16 bits (uint16) to float32, exactly."""
        return libdevice.int_as_float(np.int32(np.int32(bits) << np.int32(16)))

    # numba types uint32 + uint32 as uint64, and a 64-bit sum shifted right keeps its carry: a
    # rounding written as one expression added and shifted in 64 bits (IADD3 + IADD3.X + SHF.R.U64
    # a value in the SASS). The two below cast the sum back to uint32 before any shift, and LLVM
    # then narrows the whole chain to 32 bits (session 37). Same bits: a non-NaN u is at most
    # 0xFF800000 (-inf), so u + 0x7FFF + 1 never wraps 32 bits; NaN has its own branch.

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(x):
        """float32 to bf16 bits, round to nearest even (NaN stays NaN), in 32-bit arithmetic."""
        u = np.uint32(libdevice.float_as_int(x))
        if x != x:
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        r = np.uint32(u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
        return np.uint16(r >> np.uint32(16))

    @cuda.jit(device=True, inline=True)
    def round_bf16(x):
        """bf16_to_f32(f32_to_bf16(x)) (the same bits: x rounded to bf16, as float32) in 32-bit
        integer arithmetic, the low half masked off instead of shifted down and back."""
        u = np.uint32(libdevice.float_as_int(x))
        if x != x:
            r = np.uint32(u | np.uint32(0x400000))
        else:
            r = np.uint32(u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
        return libdevice.int_as_float(np.int32(r & np.uint32(0xFFFF0000)))


def synchronize() -> None:
    """Wait for all work on the current device."""
    cuda.synchronize()


def median_seconds(fn, repeat: int = 20) -> float:
    """Median device time of `fn()` over `repeat` calls (CUDA events), after one warm-up."""
    fn()
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(np.median(times))


def device_name() -> str:
    """Name of the current CUDA device."""
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


@cuda.jit
def _spin_kernel(iterations, out):
    # one thread: a chain of dependent multiply-adds (about 2 ns each at full clock)
    x = np.float32(iterations & 7)
    for _ in range(iterations):
        x = x * np.float32(0.999) + np.float32(1.0)
    out[0] = x


def spin(ms: float, stream=0) -> None:
    """Keep the device busy for at least about `ms` milliseconds (one thread, longer at
    low clocks), so that work the host enqueues behind it runs back to back and events
    time the device alone."""
    _spin_kernel[1, 1, stream](int(ms * 5e5), cuda.device_array(1, np.float32, stream=stream))


def device_seconds(fn, repeat: int = 20, spin_ms: float = 50.0) -> float:
    """Device seconds per call of `fn()` (which launches on the default stream): one
    warm-up, then `repeat` calls enqueued behind `spin` and timed between two events,
    so host launch costs are not counted (frees deferred meanwhile: they synchronize)."""
    fn()
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    with cuda.defer_cleanup():
        spin(spin_ms)
        start.record()
        for _ in range(repeat):
            fn()
        stop.record()
        stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / repeat


class CallTimer:
    """Device time of wrapped calls, by label: an event pair on the default stream around
    each call (run the timed work behind `spin` so launches queue up and the pairs time
    the kernels, not the host)."""

    def __init__(self) -> None:
        self._records: list[tuple[str, object, object]] = []

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start, stop = cuda.event(), cuda.event()
            start.record()
            result = fn(*args, **kwargs)
            stop.record()
            self._records.append((label, start, stop))
            return result

        return timed

    def totals(self) -> dict[str, tuple[float, int]]:
        """{label: (device seconds, calls)}, after waiting for the device."""
        cuda.synchronize()
        out: dict[str, tuple[float, int]] = {}
        for label, start, stop in self._records:
            seconds, calls = out.get(label, (0.0, 0))
            out[label] = (seconds + start.elapsed_time(stop) / 1e3, calls + 1)
        return out


def deferred_frees():
    """A context in which no device memory is freed (a free synchronizes the device)."""
    return cuda.defer_cleanup()


def release_memory() -> None:
    """Free device arrays that are no longer referenced now (numba defers frees)."""
    cuda.synchronize()
    cuda.current_context().deallocations.clear()


def new_event():
    """A CUDA event (for benchmarks' device timing)."""
    return cuda.event()


def new_stream():
    """A new CUDA stream."""
    return cuda.stream()


def elapsed_seconds(start, stop) -> float:
    """Seconds between two recorded events (waits for `stop`)."""
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3
