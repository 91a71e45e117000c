"""Device memory for kept states: a CUDA stream-ordered memory pool, reserved up front.

A keep allocates its payload (`state.StatePool.pack_fixed`, `pack_rows`) while the prompt
cache grows. From `device.POOL` that is a cuMemAlloc of memory the process never held: on
the H200 a whole 2B state at 576 rows (26.6 MB) took 1.47-1.85 ms that way against 0.33-0.43
ms into cached blocks and 0.57 ms from reserved memory (bench/RESULTS.md, session 12), and
the server's keeps (~20 MB each) cost ~0.95 ms where the profile, timed after the pool gave
its blocks back, charged 0.53. A size-class cache does not help:
every keep has its own size (the K/V rows above its parent), and the classes round up by up
to 25%, which the store does not count.

So payloads come from a `cuMemPoolCreate` pool (the driver's suballocator: exact sizes,
reuse of freed memory of any size) that never gives memory back on its own (release
threshold: no limit), and `reserve` grows it once at start-up to the budget or what the
device can spare (one allocation, freed at once: the pool keeps the memory), as vLLM sizes
its KV block pool before serving. A keep copies before its commit evicts, so at a full cache
the pool briefly holds the budget and one keep; that growth stays in the pool for the next
keeps instead of being mapped again each time. On an allocation failure the device pool's
cached blocks are given back and the allocation tried once more; the device pool's own
failures trim this pool's unused memory (`trim`, via `DevicePool.on_oom`). Allocations and
frees are stream-ordered on the legacy default stream, where every payload copy runs. A
payload may die on any thread (the runtime drops evicted payloads in the serving loop); its
free is queued and issued by the next allocation, on the thread that does the device work.

Source: CUDA Driver API, "Stream Ordered Memory Allocator" (cuMemPoolCreate,
cuMemPoolSetAttribute CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cuMemAllocFromPoolAsync,
cuMemFreeAsync, cuMemPoolTrimTo).
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import structlog
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, LeanArray

log = structlog.get_logger()

try:
    from cuda.bindings import driver as _driver
except ImportError:  # CPU-only installs: no CacheMemory (payloads use device.POOL)
    _driver = None


def _checked(result):
    if result[0] != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {result[0]}")
    return result[1] if len(result) == 2 else None


class _Lease:
    """A payload buffer in use: its free is queued when the last array on it is gone."""

    __slots__ = ("memory", "ptr", "nbytes")

    def __init__(self, memory: "CacheMemory", ptr: int, nbytes: int) -> None:
        self.memory, self.ptr, self.nbytes = memory, ptr, nbytes

    def __del__(self) -> None:
        try:
            self.memory._give(self.ptr, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the memory goes with the process
            pass


class CacheMemory:
    """A stream-ordered device memory pool for kept states (see the module docstring).

    `array` has `device.DevicePool.array`'s signature, so `device.using_pool(memory)` routes
    `device.empty` here. held_bytes: bytes of live payload buffers (freed ones excluded once
    their free is queued). reserved_bytes: the largest `reserve` that succeeded. Raises
    RuntimeError when the driver has no memory pools (use `CacheMemory.create`).
    """

    def __init__(self) -> None:
        if _driver is None or IS_SIMULATOR:
            raise RuntimeError("stream-ordered memory pools need cuda.bindings and a GPU")
        cuda.current_context()
        device = _checked(_driver.cuCtxGetDevice())
        props = _driver.CUmemPoolProps()
        props.allocType = _driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = _driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = int(device)
        self.handle = _checked(_driver.cuMemPoolCreate(props))
        no_limit = _driver.cuuint64_t(2**64 - 1)
        _checked(_driver.cuMemPoolSetAttribute(
            self.handle, _driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, no_limit))
        self.reserved_bytes = 0
        self.held_bytes = 0
        self._stream = _driver.CUstream(0)
        self._pending: list[int] = []
        self._lock = threading.RLock()  # RLock: a lease may die inside a locked section
        from executor.numba_cuda.device import POOL

        self._device_pool = POOL
        ref = weakref.ref(self)  # the device pool's hook must not keep this pool alive

        def trim() -> None:
            memory = ref()
            if memory is not None:
                memory.trim()

        self._oom_hook = trim
        if POOL is not None:
            POOL.on_oom.append(trim)

    def close(self) -> None:
        """Destroy the pool: its reserved memory goes back to the device (the driver waits
        for queued frees). Called when the last reference goes (the backend that set it as
        `StatePool.memory`), so a process that builds several backends (bench/profile.py's
        presets) does not keep each one's reserve."""
        if self.handle is None:
            return
        if self._device_pool is not None and self._oom_hook in self._device_pool.on_oom:
            self._device_pool.on_oom.remove(self._oom_hook)
        cuda.current_context()
        self._drain()
        _checked(_driver.cuMemPoolDestroy(self.handle))
        self.handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the memory goes with the process
            pass

    @classmethod
    def create(cls) -> "CacheMemory | None":
        """A CacheMemory, or None (logged) where the driver or device has no memory pools."""
        try:
            return cls()
        except Exception as exc:  # noqa: BLE001 - an old driver: payloads stay on device.POOL
            log.warning("cache_memory_off", reason=repr(exc))
            return None

    def reserve(self, nbytes: int) -> int:
        """Grow the pool to hold `nbytes` (one allocation, freed at once; the release
        threshold keeps the memory). Returns the bytes reserved: `nbytes`, or 0 when the
        device cannot give them (logged; keeps then grow the pool as they come)."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            return 0
        try:
            ptr = _checked(_driver.cuMemAllocFromPoolAsync(nbytes, self.handle, self._stream))
            _checked(_driver.cuMemFreeAsync(ptr, self._stream))
            cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - out of memory: reserve nothing, serve on
            log.warning("cache_memory_reserve_failed", bytes=nbytes, error=repr(exc))
            return 0
        self.reserved_bytes = max(self.reserved_bytes, nbytes)
        return nbytes

    def array(self, shape: tuple, dtype: np.dtype, stream=0) -> LeanArray:
        """A C-contiguous `LeanArray` of `shape` (all > 0) and `dtype` from the pool, ordered
        on the legacy default stream. On an allocation failure the device pool's cached blocks
        are given back and it is tried once more; raises RuntimeError when that fails too."""
        cuda.current_context()  # numba's context is current on this thread
        self._drain()
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        try:
            ptr = int(_checked(_driver.cuMemAllocFromPoolAsync(nbytes, self.handle, self._stream)))
        except RuntimeError:
            if self._device_pool is None:
                raise
            self._device_pool.release()
            ptr = int(_checked(_driver.cuMemAllocFromPoolAsync(nbytes, self.handle, self._stream)))
        with self._lock:
            self.held_bytes += nbytes
        return LeanArray.c_contiguous(ptr, tuple(shape), np.dtype(dtype), _Lease(self, ptr, nbytes))

    def _give(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._pending.append(ptr)
            self.held_bytes -= nbytes

    def trim(self) -> None:
        """Give the pool's unused memory back to the device (`cuMemPoolTrimTo` to 0: live
        payloads stay). The device pool calls it before retrying a failed allocation."""
        self._drain()
        cuda.synchronize()
        _checked(_driver.cuMemPoolTrimTo(self.handle, 0))

    def _drain(self) -> None:
        """Issue the queued frees (stream-ordered: after the work already queued on them);
        a free the driver refuses is logged and dropped (its memory stays with the pool)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for ptr in pending:
            try:
                _checked(_driver.cuMemFreeAsync(_driver.CUdeviceptr(ptr), self._stream))
            except RuntimeError as exc:
                log.error("cache_memory_free_failed", ptr=ptr, error=repr(exc))
