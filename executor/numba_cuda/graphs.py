"""CUDA graphs of the numba-cuda backend's decode step, applied to a built backend.

`DecodeGraphs(backend).decode` is a drop-in for `backend.decode`. The first round at a
lane count runs the step eagerly once to record its buffers (the lanes' recurrent and
conv state saved before and put back after, so the round is not applied twice), then
captures the same launches on a private stream into a graph; each round at that lane
count copies its inputs into the graph's input buffers and replays the graph: about a
microsecond per launch on the device instead of tens of host microseconds. The inputs go
up as one copy from a pinned host array and the logits come back into a pinned host
array (pageable copies stage through driver buffers: slower, and synchronous). The kernels,
inputs and buffers are those of the eager step, so logits and states are bit-identical
to it (tests/executor/numba_cuda/test_gpu_backend.py::test_decode_graphs_equal_eager).
The decode attention's split grid is sized for the pool's capacity; splits past a lane's
position exit at once and change no bit. Prefill is not captured (few, large launches).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
from numba import cuda

from executor.numba_cuda.device import StepBuffers, to_device

try:
    from cuda.bindings import driver as _driver
except ImportError:  # CPU-only installs: DecodeGraphs refuses to start
    _driver = None


def _checked(result):
    """The value of a cuda.bindings driver call; raises RuntimeError on an error code."""
    if result[0] != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {result[0]}")
    return result[1] if len(result) == 2 else None


def _cu_stream(stream):
    handle = stream.handle
    if isinstance(handle, _driver.CUstream):
        return handle
    return _driver.CUstream(int(getattr(handle, "value", handle) or 0))


@attrs.define(eq=False)
class _Graph:
    """One captured decode step: device inputs (ids, positions, slots as the rows of one
    i32 [3, lanes] array, and row_start), the logits buffer, pinned host mirrors of the
    inputs and logits, everything it owns."""

    inputs: object
    row_start: object
    logits: object
    host_inputs: np.ndarray
    host_logits: np.ndarray
    buffers: StepBuffers
    graph: object
    executable: object


class DecodeGraphs:
    """Captured decode steps of one backend, one per lane count (see module docstring)."""

    def __init__(self, backend) -> None:
        if _driver is None:
            raise RuntimeError("CUDA graphs need cuda.bindings (cuda-python)")
        self.backend = backend
        self.stream = cuda.stream()
        self._graphs: dict[int, _Graph] = {}

    def decode(self, states: Sequence, token_ids: Sequence[int]) -> np.ndarray:
        """`Backend.decode` through the captured step of this lane count."""
        backend = self.backend
        ids, positions, slots = backend.decode_inputs(states, token_ids)
        graph = self._graphs.get(len(states))
        if graph is None:
            graph = self._graphs[len(states)] = self._capture(ids, positions, slots)
        stream = self.stream
        graph.host_inputs[0], graph.host_inputs[1], graph.host_inputs[2] = ids, positions, slots
        graph.inputs.copy_to_device(graph.host_inputs, stream=stream)
        _checked(_driver.cuGraphLaunch(graph.executable, _cu_stream(stream)))
        graph.logits.copy_to_host(graph.host_logits, stream=stream)
        stream.synchronize()
        logits = graph.host_logits.copy()
        backend.advance(states, logits)
        return logits

    def prepare(self, lane_counts) -> None:
        """Capture the step for each lane count now (a server does this before it says
        ready, so no round pays the capture: 0.3 to 1.3 s at 27B). Uses fresh pool slots at
        row 0, released afterwards; needs max(lane_counts) free slots."""
        backend = self.backend
        for lanes in lane_counts:
            if lanes in self._graphs:
                continue
            states = [backend.new_state() for _ in range(lanes)]
            try:
                zeros = np.zeros(lanes, np.int32)
                self._graphs[lanes] = self._capture(zeros, zeros, np.asarray([s.slot for s in states], np.int32))
            finally:
                for state in states:
                    backend.release(state)

    def _capture(self, ids, positions, slots) -> _Graph:
        backend, stream = self.backend, self.stream
        lanes = len(ids)
        packed = to_device(np.stack([ids, positions, slots]).astype(np.int32), stream)
        row_start = to_device(np.arange(lanes + 1, dtype=np.int32), stream)
        inputs = [packed[0], packed[1], packed[2], row_start]
        max_pos = backend.pool.capacity_rows - 1
        cuda.synchronize()
        saved = [backend.pool.pack(int(slot), 0) for slot in slots]
        buffers = StepBuffers()
        with buffers.recording():
            backend.decode_step(*inputs, max_pos, stream)
        stream.synchronize()
        for slot, data in zip(slots, saved):
            backend.pool.unpack(data, int(slot), 0)
        cuda.synchronize()
        handle = _cu_stream(stream)
        with cuda.defer_cleanup(), buffers.replaying():
            _checked(_driver.cuStreamBeginCapture(handle, _driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
            try:
                logits = backend.decode_step(*inputs, max_pos, stream)
            except BaseException:
                _driver.cuStreamEndCapture(handle)
                raise
            graph = _checked(_driver.cuStreamEndCapture(handle))
        executable = _checked(_driver.cuGraphInstantiate(graph, 0))
        return _Graph(packed, row_start, logits, cuda.pinned_array((3, lanes), np.int32),
                      cuda.pinned_array(tuple(logits.shape), np.float32), buffers, graph, executable)

    def replay_seconds(self, lanes: int, repeat: int = 10) -> float:
        """Device seconds per replay of the captured step for `lanes` lanes, replayed
        `repeat` times with its last inputs (benchmarks only: each replay advances those
        lanes' pool states again while their `DeviceState`s stay put)."""
        graph, stream = self._graphs[lanes], self.stream
        start, stop = cuda.event(), cuda.event()
        start.record(stream=stream)
        for _ in range(repeat):
            _checked(_driver.cuGraphLaunch(graph.executable, _cu_stream(stream)))
        stop.record(stream=stream)
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / repeat

    def close(self) -> None:
        """Destroy the captured graphs (their buffers go with them)."""
        for graph in self._graphs.values():
            _driver.cuGraphExecDestroy(graph.executable)
            _driver.cuGraphDestroy(graph.graph)
        self._graphs.clear()
