"""The one device-allocation helper, bf16 bit conversions on the device, and launch sizes.

Every buffer a kernel writes is allocated by `empty` (or `empty_like`), so tests can poison
new buffers (`poisoned()`: NaN for floats, a bf16 NaN pattern for uint16, -1 for ints) and
catch outputs a kernel never wrote. bf16 values live in uint16 arrays (their bit pattern),
as in `executor/safetensors_file.py`. Nothing here computes model math.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import numpy as np
from numba import cuda

IS_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
"""True when numba.cuda is the CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before import)."""

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


def empty(shape, dtype, stream=0):
    """A new device array (uninitialised; poisoned inside `poisoned()`)."""
    dtype = np.dtype(dtype)
    array = cuda.device_array(shape, dtype=dtype, stream=stream)
    if _poison.get() and array.size:
        array.copy_to_device(np.full(array.shape, _poison_value(dtype), dtype=dtype), stream=stream)
    return array


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
        times.append(cuda.event_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def device_name() -> str:
    """Name of the current CUDA device."""
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)
