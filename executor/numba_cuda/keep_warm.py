"""Keep the GPU busy while the server waits for work (`python -m executor.serve --keep-gpu-warm`).

Why: on the H200 machine the host calls of a step that follows an idle spell take longer than
back to back, whatever the CPU did meanwhile. The 27B off-grid continuation's step (restore
at row 1,984, then the 51-row chunk through its CUDA graph) took 19.70 ms back to back and
20.10 ms after the host slept 20 ms; 20.17 ms when the host spun instead of sleeping; a tiny
kernel every 0.25 ms during the idle spell won back only 0.14 ms of the 0.40 (bench/RESULTS.md,
session 24). The GPU itself runs its clocks down while idle (nvidia-smi reads 345 MHz of 1,980).

How: `KeepWarm.start()` launches one thread (keep_warm.cu) on a stream of its own that polls a
flag in mapped host memory and returns when `stop()` sets it (a store to host memory, no
driver call: the thread sees it within a few microseconds) or after `max_s` seconds; the
runtime starts it when it goes idle, asks again every `runtime.KEEP_WARM_WAKE_S` while idle
(a launch that returned is launched again), and stops it before it hands a step to the
worker and when its driver exits. The stream is a blocking one: work on the legacy default
stream waits for the kernel, so nothing may touch the device while it runs (the runtime
does no device work while idle). The cost is the power of a GPU that never idles. Not
available under the CUDA simulator (its launches run to completion in the caller's thread).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, device_pointer

SOURCE = Path(__file__).with_name("keep_warm.cu")
"""The CUDA C++ source of the spinning device function."""


@functools.cache
def _kernel():
    fn = cuda.declare_device("keep_warm_spin", "int32(int64, int64)")

    @cuda.jit("void(int64, int64)", link=[str(SOURCE)], lto=True)
    def keep_warm(flag, max_ns):
        fn(flag, max_ns)

    return keep_warm


class KeepWarm:
    """A one-thread kernel that runs between `start()` and `stop()` (or for at most `max_s`
    seconds: the next `start()` after that launches it again).

    Raises RuntimeError under the CUDA simulator; ValueError when max_s is not a positive
    number of seconds."""

    def __init__(self, max_s: float = 1.0) -> None:
        if IS_SIMULATOR:
            raise RuntimeError("keep-warm needs a real GPU (the CUDA simulator runs a launch to completion)")
        if not isinstance(max_s, (int, float)) or not 0 < max_s <= 3600:
            raise ValueError(f"max_s must be in (0, 3600] seconds, got {max_s!r}")
        self.max_ns = int(max_s * 1e9)
        self._flag = cuda.mapped_array(1, np.int32)
        self._flag_ptr = device_pointer(self._flag)
        self._stream = cuda.stream()
        self._kernel = _kernel()
        self._done = cuda.event(timing=False)  # recorded behind each launch: `finished`
        self.running = False
        """A launch not yet stopped (it may have returned by itself after max_s)."""
        self.starts = 0
        """Launches so far (for tests and logs)."""

    def start(self) -> None:
        """Launch the spinning thread unless one runs (not stopped and not returned after
        max_s); one launch and an event record, or one event query when it runs."""
        if self.running and not self.finished():
            return
        self._flag[0] = 0
        self._kernel[1, 1, self._stream](self._flag_ptr, self.max_ns)
        self._done.record(self._stream)
        self.running = True
        self.starts += 1

    def stop(self) -> None:
        """Let the spinning thread return (a store to host memory; it does not wait)."""
        if self.running:
            self._flag[0] = 1
            self.running = False

    def finished(self) -> bool:
        """Whether the last launch has returned (an event query)."""
        return bool(self._done.query())

    def close(self) -> None:
        """Stop and wait for the thread to return."""
        self.stop()
        self._done.synchronize()
