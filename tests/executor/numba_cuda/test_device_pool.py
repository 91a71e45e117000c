"""`DevicePool`'s bookkeeping without a GPU (executor/numba_cuda/device.py): the driver's
cuMemAlloc / cuMemFree and numba's synchronize are fakes that record pointers, so a test can
check that every block the pool took is freed exactly once.

A lease can die inside the pool's own locked sections (a garbage collection frees a
reference cycle holding an array; the lock is an RLock, so its `_give` gets in). Here a
free list whose iteration runs a collection makes that happen, deterministically, while
`release` walks the lists.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
from numba.cuda.cudadrv import driver as numba_driver

from executor.numba_cuda import device


class FakeDriver:
    """cuMemAlloc hands out distinct pointers (failing once, out of memory, when asked);
    cuMemFree records each pointer it is given."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.freed: list[int] = []
        self.fail_next_alloc = False

    def cuMemAlloc(self, size: int) -> int:
        if self.fail_next_alloc:
            self.fail_next_alloc = False
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        ptr = 0x10000 * (len(self.allocated) + 1)
        self.allocated.append(ptr)
        return ptr

    def cuMemFree(self, ptr: int) -> None:
        self.freed.append(ptr)


class FakeCuda:
    """The parts of `numba.cuda` the pool calls."""

    def synchronize(self) -> None:
        pass

    def current_context(self):
        return SimpleNamespace(deallocations=SimpleNamespace(clear=lambda: None))


class CollectingList(list):
    """A free list whose iteration runs a garbage collection first (as an allocation inside
    the loop may), which frees whatever lease only a reference cycle still holds."""

    def __iter__(self):
        gc.collect()
        return super().__iter__()


@pytest.fixture
def fake_driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(numba_driver, "driver", fake)
    monkeypatch.setattr(device, "cuda", FakeCuda())
    enabled = gc.isenabled()
    gc.disable()  # the cycle below dies only when the test says so
    yield fake
    if enabled:
        gc.enable()


def _in_a_cycle(array) -> None:
    loop = [array]
    loop.append(loop)


@pytest.mark.parametrize("late_class", ["new", "walked"], ids=["late-new-size-class", "late-walked-size-class"])
@pytest.mark.parametrize("entry", ["release", "out-of-memory-retry"])
def test_a_lease_dying_while_release_walks_the_free_lists_is_freed_once_later(fake_driver, late_class, entry):
    pool = device.DevicePool(limit_bytes=1 << 20)
    f32 = np.dtype(np.float32)
    if late_class == "walked":  # the late block's size class is walked before the collecting list
        early = pool.array((128,), f32)  # 512-byte class
        del early
    big = pool.array((256,), f32)  # 1024-byte class
    _in_a_cycle(pool.array((128,), f32))  # 512-byte class: given back only by a collection
    del big
    pool._free[1024] = CollectingList(pool._free[1024])

    if entry == "release":
        pool.release()
        held = None
    else:
        fake_driver.fail_next_alloc = True
        held = pool.array((512,), f32)  # a 2048-byte miss: the allocation fails, release, retry
        assert held.ptr == fake_driver.allocated[-1]
    assert len(fake_driver.freed) == len(set(fake_driver.freed))
    assert pool.cached_bytes == 512, "the block given back during release is neither cached nor freed"
    del held
    pool.release()

    assert sorted(fake_driver.freed) == sorted(fake_driver.allocated)  # each block freed exactly once
    assert pool.cached_bytes == 0


def test_an_allocation_failure_runs_the_on_oom_hooks_before_the_retry(fake_driver):
    """After its own cached blocks, the pool asks the others (the cache memory's `trim`) to
    give unused memory back, then tries once more; a pool without release_on_oom raises."""
    pool = device.DevicePool(limit_bytes=1 << 20)
    order = []
    pool.on_oom.append(lambda: order.append(("hook", len(fake_driver.allocated))))
    fake_driver.fail_next_alloc = True
    held = pool.array((64,), np.dtype(np.float32))
    assert order == [("hook", 0)] and held.ptr == fake_driver.allocated[-1] and len(fake_driver.allocated) == 1
    strict = device.DevicePool(limit_bytes=1 << 20, release_on_oom=False)
    strict.on_oom.append(lambda: order.append("strict hook"))
    fake_driver.fail_next_alloc = True
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        strict.array((64,), np.dtype(np.float32))
    assert order == [("hook", 0)]


def test_live_and_peak_bytes_count_blocks_in_use_by_size_class(fake_driver):
    """live_bytes: the blocks handed out and not given back, in size-class bytes (a 1000-byte
    array takes a 1024-byte block); peak_bytes: their most since reset_peak. A cache hit
    counts as a miss does, and a block past the cache limit (retired) leaves live too."""
    pool = device.DevicePool(limit_bytes=1536)
    u8 = np.dtype(np.uint8)
    a = pool.array((1000,), u8)
    b = pool.array((2000,), u8)  # 2048-byte block
    assert (pool.live_bytes, pool.peak_bytes) == (3072, 3072)
    del a
    assert (pool.live_bytes, pool.peak_bytes, pool.cached_bytes) == (2048, 3072, 1024)
    pool.reset_peak()
    assert pool.peak_bytes == 2048
    c = pool.array((1024,), u8)  # the cached 1024-byte block
    assert (pool.live_bytes, pool.peak_bytes, pool.hits) == (3072, 3072, 1)
    del b  # 1024 cached + 2048 > 1536: retired
    assert (pool.live_bytes, pool.cached_bytes, len(pool._retired)) == (1024, 0, 1)
    del c
    pool.release()
    assert (pool.live_bytes, pool.peak_bytes) == (0, 3072)
    assert sorted(fake_driver.freed) == sorted(fake_driver.allocated)
