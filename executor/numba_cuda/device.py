"""The one device-allocation helper, bf16 bit conversions on the device, and launch sizes.

Every buffer a kernel writes is allocated by `empty`, so tests can poison new buffers
(`poisoned()`: NaN for floats, a bf16 NaN pattern for uint16, -1 for ints) and catch
outputs a kernel never wrote, and so a CUDA graph capture can replay one step's buffers
(`StepBuffers`). bf16 values live in uint16 arrays (their bit pattern), as in
`executor/safetensors_file.py`. Nothing here computes model math.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import threading

import numpy as np
from numba import cuda

IS_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
"""True when numba.cuda is the CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before import)."""

if not IS_SIMULATOR:  # DevicePool and ColumnSlicer build arrays on these (the simulator has neither)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.cudadrv.driver import AutoFreePointer

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


class StepBuffers:
    """The buffers `empty` hands out during one step, in order: inside `recording()` each
    new buffer is kept; inside `replaying()` the kept buffers come back in the same order
    (same shapes and dtypes, else RuntimeError), so a second run of the same step (a CUDA
    graph capture) allocates nothing and the buffers outlive it."""

    def __init__(self) -> None:
        self.buffers: list = []
        self._next = 0

    @contextlib.contextmanager
    def recording(self):
        token = _step.set((self, False))
        try:
            yield self
        finally:
            _step.reset(token)

    @contextlib.contextmanager
    def replaying(self):
        self._next = 0
        token = _step.set((self, True))
        try:
            yield self
        finally:
            _step.reset(token)
        if self._next != len(self.buffers):
            raise RuntimeError(f"the replayed step took {self._next} of {len(self.buffers)} recorded buffers")

    def _take(self, shape: tuple, dtype: np.dtype):
        if self._next >= len(self.buffers):
            raise RuntimeError("the replayed step allocates more buffers than the recorded one")
        array = self.buffers[self._next]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise RuntimeError(f"replayed buffer {self._next}: {shape} {dtype} != recorded {array.shape} {array.dtype}")
        self._next += 1
        return array


_step: contextvars.ContextVar[tuple[StepBuffers, bool] | None] = contextvars.ContextVar("warmstate_step", default=None)


def _size_class(nbytes: int) -> int:
    """Bytes of the pool block that serves `nbytes`: 512-byte steps up to 64 KiB, then
    quarter steps between powers of two (at most 25% of a block unused)."""
    if nbytes <= 1 << 16:
        return -(-nbytes // 512) * 512
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class DevicePool:
    """A stream-ordered cache of device memory behind `empty` (as PyTorch's caching
    allocator): an array's block goes back to the pool when the array and every view of
    it are gone, and the next `empty` of that size class reuses it at once. Safe because
    every launch here is ordered after the earlier ones (one stream, or blocking streams
    with the legacy default stream), so work queued on the old array runs first.

    Why: numba allocates each array with cuMemAlloc and frees in batches of ten with
    cuMemFree, which waits for the device, so a prefill chunk of a few rows (hundreds of
    small buffers) was bound by allocation round trips, not by its kernels. Free blocks
    are kept up to `limit_bytes`; past it a returned block is freed. On an allocation
    failure the free blocks are released and the allocation tried once more.
    Enabled unless WARMSTATE_DEVICE_POOL=0; the simulator never pools.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.cached_bytes = 0
        self.hits = self.misses = 0
        self._free: dict[int, list] = {}
        self._live: dict[int, object] = {}
        self._lock = threading.Lock()
        self._next = 0

    def _block(self, size: int):
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                self.cached_bytes -= size
                self.hits += 1
                return blocks.pop()
            self.misses += 1
        try:
            return cuda.device_array(size, np.uint8)
        except Exception:  # noqa: BLE001 - out of memory: give the cached blocks back and retry once
            self.release()
            return cuda.device_array(size, np.uint8)

    def _give(self, key: int, block) -> None:
        with self._lock:
            self._live.pop(key, None)
            size = block.shape[0]
            if self.cached_bytes + size <= self.limit_bytes:
                self._free.setdefault(size, []).append(block)
                self.cached_bytes += size

    def release(self) -> None:
        """Free every cached block now."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0
        cuda.synchronize()
        cuda.current_context().deallocations.clear()

    def array(self, shape: tuple, dtype: np.dtype, stream=0):
        """A C-contiguous device array of `shape` and `dtype` on a pooled block."""
        nbytes = math.prod(shape) * dtype.itemsize
        block = self._block(_size_class(nbytes))
        root = block.gpu_data
        with self._lock:
            key = self._next
            self._next += 1
        mem = AutoFreePointer(root.context, root.device_pointer, nbytes, finalizer=functools.partial(self._give, key, block))
        with self._lock:
            self._live[key] = mem  # the views hold only weak proxies: keep it until they are gone
        strides, acc = [], dtype.itemsize
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return DeviceNDArray(shape, tuple(reversed(strides)), dtype, stream=stream, gpu_data=mem.own())


POOL = None if IS_SIMULATOR or os.environ.get("WARMSTATE_DEVICE_POOL", "1") == "0" else DevicePool(
    int(float(os.environ.get("WARMSTATE_DEVICE_POOL_GIB", "16")) * (1 << 30)))
"""The process's device pool (None: plain numba allocations)."""


def empty(shape, dtype, stream=0):
    """A new device array (uninitialised; poisoned inside `poisoned()`; the recorded one
    inside `StepBuffers.replaying()`; from `POOL` when it is on)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in (shape if isinstance(shape, tuple) else (shape,)))
    step = _step.get()
    if step is not None and step[1]:
        return step[0]._take(shape, dtype)
    if POOL is not None and all(shape):
        array = POOL.array(shape, dtype, stream)
    else:
        array = cuda.device_array(shape, dtype=dtype, stream=stream)
    if _poison.get() and array.size:
        array.copy_to_device(np.full(array.shape, _poison_value(dtype), dtype=dtype), stream=stream)
    if step is not None:
        step[0].buffers.append(array)
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
    """A new device array of zeros (state buffers start at zero by definition)."""
    array = cuda.device_array(shape, dtype=np.dtype(dtype), stream=stream)
    if array.size:
        array.copy_to_device(np.zeros(array.shape, dtype=dtype), stream=stream)
    return array


def to_device(host: np.ndarray, stream=0):
    """Copy a host array into a new (contiguous) device array."""
    return cuda.to_device(np.ascontiguousarray(host), stream=stream)


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

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(bits):
        """bf16 bits (uint16) to float32, exactly."""
        return libdevice.int_as_float(np.int32(np.int32(bits) << np.int32(16)))

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(x):
        """float32 to bf16 bits, round to nearest even (NaN stays NaN)."""
        u = np.uint32(libdevice.float_as_int(x))
        if x != x:
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return np.uint16(r)


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
