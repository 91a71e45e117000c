"""CUDA graphs of the numba-cuda backend's decode step and short prefill chunks, applied to
a built backend.

`DecodeGraphs(backend).decode` is a drop-in for `backend.decode`. The first round at a
lane count runs the step eagerly twice, on the process's pool (it compiles) and on the
graphs' private pool (it fills it with every block the step takes), the lanes' recurrent
and conv state saved before and put back after, so the round is not applied twice, then
captures the same launches on a private stream into a graph, its buffers from the private
pool (every lane count's graph shares its blocks: one step's buffers, not one per lane count); each round at that lane
count copies its inputs into the graph's input buffers and replays the graph: about a
microsecond per launch on the device instead of tens of host microseconds. The inputs go
up as one copy from a pinned host array and the logits come back into a pinned host
array (pageable copies stage through driver buffers: slower, and synchronous). The kernels,
inputs and buffers are those of the eager step, so logits and states are bit-identical
to it (tests/executor/numba_cuda/test_gpu_backend.py::test_decode_graphs_equal_eager).
The decode attention's split grid is sized for the pool's capacity; splits past a lane's
position exit at once and change no bit.

`PrefillGraphs(backend).prefill` runs a prefill chunk of at most max(BUCKETS) rows as one
captured step padded to its bucket (the smallest of BUCKETS that holds it). Why: a short
chunk is ~800 kernels at 27B (~12 a layer; 531 numba launches and 272 cuBLASLt calls), and
its launches took 28-48 ms of host time on the H200 machines against ~25 ms of kernels
(bench/RESULTS.md, sessions 8-10): host-bound, and slower still when the host is slow or
busy. The captured step is exact for any chunk of its bucket because
nothing the host fixes at capture depends on the chunk's rows, start or slot: the
tensor-core delta rule and the fused attention read (rows, start, slot) from a device
array (`meta`) with grids sized for the bucket (their extra CTAs return at once), the conv
reads its rows from row_start, a padding row's slot is -1 so it writes no cache row, and
the logits row is copied by a kernel that reads meta (elementwise.last_row). The rest is
row-wise (norms, the pinned row-invariant GEMMs, SwiGLU, RoPE): a padding row computes
garbage nobody reads, and a row's bits do not depend on the rows beside it. The last layer
always runs in full (the same logits as a tail: tail == full is tested). So a chunk gives
the eager chunk's bits (tests/executor/numba_cuda/test_gpu_prefill_graphs.py).
Capture, per bucket: one eager run on the process's pool (it compiles kernels and pins
GEMM algorithms, whose scratch must not stay in the private pool), one eager run on a
private `DevicePool` (it fills the pool with every block the step takes), timed eager runs
on it, the capture on that pool (it hands out only blocks it holds: an allocation during
capture is an error), one replay (a graph's first launch uploads it) and timed ones
(`seconds`, which `prepare(prune=True)` compares). The bucket graphs share the private
pool's blocks (they replay one at a time on one stream), so they hold about one chunk's
peak of live buffers at the largest bucket; the pool never frees a block while a graph
lives, not even on an allocation failure (`DevicePool.release_on_oom`). A bucket whose
capture fails is left out (`failed`); its chunks run in the next bucket up.
"""

from __future__ import annotations

import operator
import time
from typing import Sequence

import attrs
import numpy as np
from numba import cuda

from executor.numba_cuda import greedy
from executor.numba_cuda.attention_flash import BLOCK_KEYS
from executor.numba_cuda.device import DevicePool, to_device, using_pool

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
    i32 [3, lanes] array, and row_start), the logits buffer and each row's argmax
    (`greedy.argmax_rows`, i32 [lanes]), pinned host mirrors of the inputs, logits and
    argmax, everything it owns."""

    inputs: object
    row_start: object
    logits: object
    picks: object
    host_inputs: np.ndarray
    host_logits: np.ndarray
    host_picks: np.ndarray
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
        self.pool = DevicePool(1 << 62, release_on_oom=False)
        """The captured steps' buffers: every lane count's graph takes its blocks from here
        and gives them back after its capture (the logits and picks buffers excepted), so they share
        them (they replay one at a time on `stream`) and hold about the largest step's live
        buffers, not the sum over lane counts (a recorded-buffers scheme held 17.4 GiB for
        16 lane counts at 27B and 32768 rows: bench/RESULTS.md, session 15)."""

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
        graph.picks.copy_to_host(graph.host_picks, stream=stream)
        stream.synchronize()
        logits = graph.host_logits.copy()
        backend.advance(states, logits, graph.host_picks.tolist())
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
        # once on the process's pool (compiles), once on the private pool (fills it with every
        # block the step takes), then the lanes' states put back and the same launches captured
        def step():  # the round and its greedy picks
            logits = backend.decode_step(*inputs, max_pos, stream)
            return logits, greedy.argmax_rows(logits, stream=stream)

        step()
        with using_pool(self.pool):
            step()
        stream.synchronize()
        for slot, data in zip(slots, saved):
            backend.pool.unpack(data, int(slot), 0)
        cuda.synchronize()
        misses = self.pool.misses
        handle = _cu_stream(stream)
        with cuda.defer_cleanup(), using_pool(self.pool):
            _checked(_driver.cuStreamBeginCapture(handle, _driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
            try:
                logits, picks = step()
            except BaseException:
                _driver.cuStreamEndCapture(handle)
                raise
            graph = _checked(_driver.cuStreamEndCapture(handle))
        if self.pool.misses != misses:
            raise RuntimeError(f"the captured decode step of {lanes} lanes allocated {self.pool.misses - misses} "
                               "new blocks during capture")
        executable = _checked(_driver.cuGraphInstantiate(graph, 0))
        _checked(_driver.cuGraphUpload(executable, handle))  # else the first round pays the upload
        stream.synchronize()
        return _Graph(packed, row_start, logits, picks, cuda.pinned_array((3, lanes), np.int32),
                      cuda.pinned_array(tuple(logits.shape), np.float32), cuda.pinned_array(lanes, np.int32),
                      graph, executable)

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
        """Destroy the captured graphs and free their private pool."""
        for graph in self._graphs.values():
            _driver.cuGraphExecDestroy(graph.executable)
            _driver.cuGraphDestroy(graph.graph)
        self._graphs.clear()
        self.pool.release()


BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
"""Padded row counts of the captured prefill chunks (vLLM pads to capture sizes the same
way): a chunk of n rows runs in the smallest bucket >= n. How far a graph pays depends on
the model and the host: past 256 rows a 27B chunk's kernels outlast its launches, while a
2B chunk of 512 or 1024 rows is still host-bound (RESULTS.md). So `prepare(prune=True)`,
which the server uses, times each bucket at capture, leaves out a bucket whose replay is not
faster than the eager chunk it competes with, and stops where the graph has stopped paying
(`PrefillGraphs.prepare`)."""


@attrs.define(eq=False)
class _PrefillGraph:
    """One captured chunk of `rows` (padded) rows: the device inputs (i32 [3 rows + 6]: ids |
    positions | row slots | lane slot | row_start | meta), the logits buffer f32 [1, vocab]
    and its argmax (i32 [1], `greedy.argmax_rows`), their pinned host mirrors, the graph."""

    rows: int
    inputs: object
    logits: object
    picks: object
    host_inputs: np.ndarray
    host_logits: np.ndarray
    host_picks: np.ndarray
    graph: object
    executable: object


class PrefillGraphs:
    """Captured prefill chunks of one backend, one per bucket (see module docstring).

    buckets: padded row counts, ints in [1, capacity] whose key blocks (BLOCK_KEYS) fit the
    pool's capacity. Raises RuntimeError without cuda.bindings, and ValueError naming
    `buckets` otherwise. `failed`: bucket -> why its capture failed (it left `buckets`)."""

    def __init__(self, backend, buckets=BUCKETS) -> None:
        if _driver is None:
            raise RuntimeError("CUDA graphs need cuda.bindings (cuda-python)")
        self.buckets = check_buckets(buckets, backend.pool.capacity_rows)
        self.backend = backend
        self.stream = cuda.stream()
        self.pool = DevicePool(1 << 62, release_on_oom=False)  # private: these graphs' buffers, never retired
        self._graphs: dict[int, _PrefillGraph] = {}
        self.failed: dict[int, str] = {}
        self.pruned: dict[int, str] = {}
        self.seconds: dict[int, tuple[float, float]] = {}
        """bucket -> (eager, graph) host wall seconds of one warm run of the bucket's chunk at
        capture (the eager launches, and one replay, each until the device is done)."""
        self.replays = 0

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows (None when none does)."""
        return bucket_for(self.buckets, rows)

    def serves(self, start: int, end: int) -> bool:
        """Whether rows [start, end) run here: a bucket holds them, and the attention's key
        blocks past `end` fit the capacity (`keys_fit`), as the eager path requires."""
        return self.bucket(end - start) is not None and keys_fit(end, self.backend.pool.capacity_rows)

    def prefill(self, slot: int, ids: np.ndarray, start: int, end: int) -> tuple[np.ndarray, int]:
        """Run rows [start, end) of the stream in `slot` (token ids `ids`, checked by the
        caller) through the captured chunk of their bucket, advancing that slot's state;
        returns the last row's logits, host f32 [vocab] (a fresh array), and their argmax
        from the device (`greedy.argmax_rows`)."""
        n = end - start
        rows = self.bucket(n)
        if rows is None:
            raise ValueError(f"rows [{start}, {end}): no bucket of {self.buckets} holds {n} rows")
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = self._capture(rows)
        _fill(graph.host_inputs, graph.rows, ids, start, slot)
        stream = self.stream
        graph.inputs.copy_to_device(graph.host_inputs, stream=stream)
        _checked(_driver.cuGraphLaunch(graph.executable, _cu_stream(stream)))
        graph.logits.copy_to_host(graph.host_logits, stream=stream)
        graph.picks.copy_to_host(graph.host_picks, stream=stream)
        stream.synchronize()
        self.replays += 1
        return graph.host_logits[0].copy(), int(graph.host_picks[0])

    def prepare(self, prune: bool = False) -> None:
        """Capture every bucket now (a server does this before it says ready, so no request
        pays a capture); uses a fresh pool slot at row 0, released afterwards. A bucket whose
        capture raises is left out of `buckets` (its chunks run in the next bucket up), with
        the reason in `failed`; RuntimeError when none is left.

        prune: keep a bucket b only when its replay is faster than the eager chunk of the
        kept bucket below it, p (`seconds`, medians of TIMED_RUNS): the fewest rows b would
        hold are p + 1, and eager time grows with rows, so a kept graph is never slower than
        eager launches for any chunk it holds. A bucket that fails is destroyed (its timings
        in `pruned`) and the next one is still tried against the same p, since replays need
        not grow with rows: on the H200 the 27B's 64-row replay (18.7 ms) beat its 32-row one
        (19.2-19.6 ms) in every server, and a 32-row replay 0.09 ms behind the eager 16-row
        chunk once pruned 64 with it, running the off-grid warm turn's 51-row chunk eagerly
        (+1.7 ms; bench/RESULTS.md, session 25). The walk stops at the first bucket whose
        replay is PRUNE_STOP times the eager chunk of p or more: the graph has stopped paying
        (kernels grow with rows, launches do not), and it and every bucket above it are left
        out without a capture ("above b"); their chunks launch eagerly. The private pool
        keeps the blocks a destroyed capture took (buckets share them; none is freed while a
        graph lives)."""
        below = None
        for i, rows in enumerate(self.buckets):
            if rows in self._graphs:
                below = rows
                continue
            try:
                self._graphs[rows] = self._capture(rows)
            except Exception as exc:  # noqa: BLE001 - the eager chunk gives the same bits
                self.failed[rows] = repr(exc)
                continue
            if prune and below in self.seconds and self.seconds[rows][1] >= self.seconds[below][0]:
                graph = self._graphs.pop(rows)
                _driver.cuGraphExecDestroy(graph.executable)
                _driver.cuGraphDestroy(graph.graph)
                replay, eager = self.seconds[rows][1], self.seconds[below][0]
                self.pruned[rows] = (f"its replay took {replay * 1e3:.2f} ms, the eager chunk of {below} rows "
                                     f"{eager * 1e3:.2f} ms")
                if replay >= PRUNE_STOP * eager:
                    self.pruned.update({b: f"above {rows}" for b in self.buckets[i + 1:]})
                    break
                continue
            below = rows
        self.buckets = tuple(b for b in self.buckets if b in self._graphs)
        if not self.buckets:
            raise RuntimeError(f"no prefill graph captured: {self.failed}")

    def _capture(self, rows: int) -> _PrefillGraph:
        backend, stream = self.backend, self.stream
        host_inputs = cuda.pinned_array(3 * rows + 6, np.int32)
        state = backend.new_state()
        try:
            _fill(host_inputs, rows, np.zeros(rows, np.int64), 0, state.slot)
            inputs = to_device(np.asarray(host_inputs), stream)
            views = _views(inputs, rows)
            # run on the process's pool (compiles, pins GEMM algorithms), then on the private
            # pool (fills it with every block the step takes), then capture the same launches:
            # the private pool hands out only blocks it holds
            def chunk():  # the padded chunk and its greedy pick
                logits = backend._forward(*views[:5], rows - 1, (state.slot, 0), 0, True, stream, views[5], True)
                return logits, greedy.argmax_rows(logits, stream=stream)

            chunk()
            stream.synchronize()
            with using_pool(self.pool):
                chunk()
                stream.synchronize()
                eager_s = _median_seconds(chunk, stream)  # warm now: the pool holds every block the step takes
            misses = self.pool.misses
            handle = _cu_stream(stream)
            with cuda.defer_cleanup(), using_pool(self.pool):
                _checked(_driver.cuStreamBeginCapture(
                    handle, _driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
                try:
                    logits, picks = chunk()
                except BaseException:
                    _driver.cuStreamEndCapture(handle)
                    raise
                graph = _checked(_driver.cuStreamEndCapture(handle))
            if self.pool.misses != misses:
                raise RuntimeError(f"the captured prefill of {rows} rows allocated {self.pool.misses - misses} "
                                   "new blocks during capture")
            executable = _checked(_driver.cuGraphInstantiate(graph, 0))
            # one replay on the capture's own slot: a graph's first launch uploads it (the
            # 2B server's first chunk of each bucket ran 1.7-2.9x the later ones, RESULTS.md)
            _checked(_driver.cuGraphLaunch(executable, handle))
            stream.synchronize()
            self.seconds[rows] = (eager_s, _median_seconds(lambda: _checked(_driver.cuGraphLaunch(executable, handle)),
                                                           stream))
        finally:
            backend.release(state)
        return _PrefillGraph(rows, inputs, logits, picks, host_inputs,
                             cuda.pinned_array(tuple(logits.shape), np.float32), cuda.pinned_array(1, np.int32),
                             graph, executable)

    def close(self) -> None:
        """Destroy the captured graphs and free their private pool."""
        for graph in self._graphs.values():
            _driver.cuGraphExecDestroy(graph.executable)
            _driver.cuGraphDestroy(graph.graph)
        self._graphs.clear()
        self.pool.release()


PRUNE_STOP = 1.1
"""`prepare(prune=True)` captures no bucket above one whose replay takes this many times the
eager chunk it competes with (the kept bucket below's): at 10% over, the next bucket, with
twice the rows, is not expected back under it. 27B on the H200, four servers: the 128-row
replay took 1.27-1.39x the eager 64-row chunk, the 32-row one 0.87-1.005x the eager 16-row
chunk, the 64-row one 0.86-0.93x the eager 32-row chunk (0.96x the eager 16-row chunk in the
server that pruned 32); bench/RESULTS.md, session 25."""

TIMED_RUNS = 3
"""Runs per timing of `_median_seconds` (the prune decision reads the medians)."""


def _median_seconds(run, stream) -> float:
    """Median host wall seconds of TIMED_RUNS calls of run() (each until the device is done)."""
    times = []
    for _ in range(TIMED_RUNS):
        t = time.perf_counter()
        run()
        stream.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def keys_fit(end: int, capacity: int) -> bool:
    """Whether the keys the fused attention reads for rows up to `end` (whole blocks of
    BLOCK_KEYS from key 0) lie within a slot of `capacity` rows."""
    return -(-end // BLOCK_KEYS) * BLOCK_KEYS <= capacity


def check_buckets(buckets: Sequence[int], capacity: int) -> tuple[int, ...]:
    """`buckets` as a sorted tuple of distinct ints, each at least 1 with its key blocks
    within the capacity (`keys_fit`). Raises ValueError naming `buckets`."""
    try:
        values = [operator.index(b) for b in buckets]
    except TypeError:
        raise ValueError(f"buckets {buckets!r} must be row counts (ints)") from None
    out = tuple(sorted(set(values)))
    if not out or out[0] < 1 or not keys_fit(out[-1], capacity):
        raise ValueError(f"buckets {out} must be row counts >= 1 whose key blocks of {BLOCK_KEYS} fit the "
                         f"capacity of {capacity} rows")
    return out


def bucket_for(buckets: Sequence[int], rows: int) -> int | None:
    """The smallest of `buckets` (ascending) that holds `rows` rows, or None."""
    for b in buckets:
        if rows <= b:
            return b
    return None


def _fill(host: np.ndarray, rows: int, ids: np.ndarray, start: int, slot: int) -> None:
    """Write a chunk of len(ids) <= rows rows from absolute row `start` of `slot` into the
    i32 input buffer of a `rows`-row bucket: ids (padding 0) | positions (padding 0) | row
    slots (padding -1: no cache row) | lane slot | row_start (0, n) | meta (n, start, slot)."""
    n = len(ids)
    host[:rows] = 0
    host[:n] = ids
    host[rows : 2 * rows] = 0
    host[rows : rows + n] = np.arange(start, start + n, dtype=np.int32)
    host[2 * rows : 3 * rows] = -1
    host[2 * rows : 2 * rows + n] = slot
    host[3 * rows :] = (slot, 0, n, n, start, slot)


def _views(inputs, rows: int) -> tuple:
    """(ids, positions, row slots, lane slots, row_start, meta) views of `_fill`'s layout."""
    r = rows
    return inputs[:r], inputs[r : 2 * r], inputs[2 * r : 3 * r], inputs[3 * r : 3 * r + 1], \
        inputs[3 * r + 1 : 3 * r + 3], inputs[3 * r + 3 :]
