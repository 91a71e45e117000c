"""The keep-warm kernel (keep_warm.py, keep_warm.cu) on a real GPU: it runs until `stop()`,
returns within milliseconds of it, returns by itself after max_s, and `start()` launches once
while it runs and again once it has returned. Marked `cuda`: the simulator cannot run linked CUDA C++ (nor a kernel that
waits for its caller), so these skip without a GPU."""

from __future__ import annotations

import time

import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from executor.numba_cuda.keep_warm import KeepWarm  # noqa: E402


def _wait_done(keep: KeepWarm, limit_s: float) -> float:
    """Seconds until the keep-warm stream has no work left (raises AssertionError past limit_s)."""
    t0 = time.perf_counter()
    while not keep.finished():
        assert time.perf_counter() - t0 < limit_s, f"the kernel still ran {limit_s} s later"
        time.sleep(1e-4)
    return time.perf_counter() - t0


def test_runs_until_stopped_and_returns_promptly():
    keep = KeepWarm(max_s=10.0)
    keep.start()
    keep.start()  # running: no second launch
    assert (keep.running, keep.starts) == (True, 1)
    time.sleep(0.05)
    assert not keep.finished()  # still spinning 50 ms later
    keep.stop()
    assert not keep.running
    assert _wait_done(keep, 0.5) < 0.05
    keep.start()  # a new idle spell: a new launch
    assert keep.starts == 2
    keep.close()
    assert keep.finished() and not keep.running


def test_returns_by_itself_after_max_s():
    keep = KeepWarm(max_s=0.05)
    keep.start()
    assert 0.02 < _wait_done(keep, 2.0) < 1.0
    assert keep.running  # returned by itself, not stopped: the next start launches again
    keep.start()
    assert keep.starts == 2 and not keep.finished()
    keep.close()


@pytest.mark.parametrize("max_s", [0, -1.0, 1e9, "1"])
def test_max_s_out_of_range_is_refused(max_s):
    with pytest.raises(ValueError, match="max_s"):
        KeepWarm(max_s=max_s)
