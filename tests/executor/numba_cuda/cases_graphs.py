"""Host side of the captured prefill chunks (graphs.PrefillGraphs): the bucket a chunk runs
in and the padded input layout its kernels read. Run by test_kernels_simulated.py under
the CUDA simulator (no graphs there: the replays are tested in test_gpu_prefill_graphs.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda import graphs


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [graphs.bucket_for(graphs.BUCKETS, n) for n in (1, 16, 17, 64, 65, 256, 257, 1024, 1025)] == [
        16, 16, 32, 64, 128, 256, 512, 1024, None]


def test_fill_pads_to_the_bucket():
    host = np.full(3 * 8 + 6, 77, np.int32)
    graphs._fill(host, 8, np.asarray([5, 6, 7, 8, 9]), 100, 3)
    ids, positions, row_slots, lane_slot, row_start, meta = graphs._views(host, 8)
    np.testing.assert_array_equal(ids, [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(positions, [100, 101, 102, 103, 104, 0, 0, 0])
    np.testing.assert_array_equal(row_slots, [3, 3, 3, 3, 3, -1, -1, -1])  # padding writes no cache row
    np.testing.assert_array_equal(lane_slot, [3])
    np.testing.assert_array_equal(row_start, [0, 5])  # the conv reads its rows here
    np.testing.assert_array_equal(meta, [5, 100, 3])  # rows in use, start, slot
    graphs._fill(host, 8, np.arange(8), 0, 1)  # a full bucket: no padding left from before
    np.testing.assert_array_equal(graphs._views(host, 8)[2], [1] * 8)


class _Stub:
    """What `NumbaCudaBackend.enable_prefill_graphs` reads before it captures anything."""

    def __init__(self, delta: str, attention: str, capacity: int) -> None:
        self._delta, self._attention = delta, attention
        self.pool = type("Pool", (), {"capacity_rows": capacity})()
        self._prefill_graphs = None
        self.prefill_graphs_off = None

    def _delta_path(self):
        return self._delta

    def _prefill_path(self):
        return self._attention


def test_prefill_graphs_need_the_device_read_paths_and_a_bucket_that_fits():
    from executor.numba_cuda.backend import NumbaCudaBackend

    for delta, attention in (("cuda-core", "flash"), ("mma", "matrix"), ("mma", "cuda-core")):
        stub = _Stub(delta, attention, 4096)
        assert NumbaCudaBackend.enable_prefill_graphs(stub) is False
        assert stub._prefill_graphs is None and f"delta {delta}, attention {attention}" in stub.prefill_graphs_off
    stub = _Stub("mma", "flash", 8)  # every bucket is past the capacity: eager, not an error
    assert NumbaCudaBackend.enable_prefill_graphs(stub) is False
    assert stub.prefill_graphs_off == "no bucket fits the capacity of 8 rows"


def test_chunk_meta_uploads_or_checks():
    from executor.numba_cuda.device import chunk_meta, to_device

    np.testing.assert_array_equal(chunk_meta(None, 5, 100, 3).copy_to_host(), [5, 100, 3])
    given = to_device(np.asarray([1, 2, 3, 4], np.int32))
    assert chunk_meta(given, 5, 100, 3) is given  # its values live on the device: not compared
    with pytest.raises(ValueError, match="meta"):
        chunk_meta(to_device(np.asarray([1, 2], np.int32)), 5, 100, 3)
    with pytest.raises(ValueError, match="meta"):
        chunk_meta(to_device(np.asarray([1, 2, 3], np.int64)), 5, 100, 3)


def test_a_failed_capture_leaves_prefill_eager():
    """No cuda.bindings (the simulator) or a capture that raises: enable_prefill_graphs says
    why and prefill stays eager; the server starts either way."""
    from executor.numba_cuda.backend import NumbaCudaBackend

    stub = _Stub("mma", "flash", 4096)
    assert NumbaCudaBackend.enable_prefill_graphs(stub) is False
    assert stub._prefill_graphs is None and stub.prefill_graphs_off.startswith("capture failed: ")


def test_a_private_pool_releases_under_the_simulator():
    """PrefillGraphs.close releases its private pool. Under the simulator that raised AttributeError
    (its context has no deallocation queue) once cuda-bindings was installed (the `sass` extra) and
    a failed capture reached close (session 33)."""
    from executor.numba_cuda.device import DevicePool

    pool = DevicePool(1 << 20, release_on_oom=False)
    pool.release()
    assert (pool.cached_bytes, pool.live_bytes) == (0, 0)


def test_buckets_are_checked_against_the_capacity():
    assert graphs.check_buckets([64, 16, 16, np.int64(32)], 64) == (16, 32, 64)
    assert graphs.check_buckets([20], 32) == (20,)  # its keys are read up to 32: fits
    for bad in ([], [0, 16], [16.5], ["16"], [33]):
        with pytest.raises(ValueError, match="buckets"):
            graphs.check_buckets(bad, 32)


class _Captures(graphs.PrefillGraphs):
    """PrefillGraphs whose capture only records timings: (eager, graph) seconds by bucket,
    or an exception to raise. Built without a device (no __init__)."""

    def __init__(self, buckets, timings):
        self.buckets, self.timings = tuple(buckets), timings
        self._graphs, self.failed, self.pruned, self.seconds = {}, {}, {}, {}
        self.destroyed = []

    def _capture(self, rows):
        if isinstance(self.timings[rows], Exception):
            raise self.timings[rows]
        self.seconds[rows] = self.timings[rows]
        return type("G", (), {"executable": f"exec {rows}", "graph": f"graph {rows}"})()


class _Driver:
    def __init__(self, log):
        self.cuGraphExecDestroy = lambda e: log.append(e)
        self.cuGraphDestroy = lambda g: log.append(g)


def test_prune_stops_at_the_first_bucket_no_faster_than_the_eager_chunk_below(monkeypatch):
    """A 2B-like host: graphs pay up to 256 rows; 512's replay (9 ms) is not faster than
    the eager 256-row chunk (8 ms), so 512 and everything above it launch eagerly, and 512's
    graph is destroyed; 1024 is never captured. A failed capture (64) is skipped: 128 is
    compared with 32's eager chunk."""
    ms = 1e-3
    timings = {16: (5 * ms, 1 * ms), 32: (5 * ms, 1 * ms), 64: RuntimeError("no"), 128: (6 * ms, 4.9 * ms),
               256: (8 * ms, 5 * ms), 512: (12 * ms, 9 * ms), 1024: (20 * ms, 15 * ms)}
    log = []
    monkeypatch.setattr(graphs, "_driver", _Driver(log))
    g = _Captures(graphs.BUCKETS, timings)
    g.prepare(prune=True)
    assert g.buckets == (16, 32, 128, 256)
    assert set(g.pruned) == {512, 1024} and "8.00 ms" in g.pruned[512] and "9.00 ms" in g.pruned[512]
    assert log == ["exec 512", "graph 512"] and 1024 not in g.seconds
    assert set(g.failed) == {64}
    # without prune every bucket stays; a replay no faster than the eager chunk below is kept
    g = _Captures(graphs.BUCKETS, timings)
    g.prepare()
    assert g.buckets == (16, 32, 128, 256, 512, 1024) and not g.pruned
    # equal times prune too (not faster); the first bucket has nothing below it
    g = _Captures((16, 32), {16: (1 * ms, 3 * ms), 32: (2 * ms, 0.5 * ms)})
    g.prepare(prune=True)
    assert g.buckets == (16, 32)
    g = _Captures((16, 32), {16: (2 * ms, 1 * ms), 32: (3 * ms, 2 * ms)})
    g.prepare(prune=True)
    assert g.buckets == (16,) and set(g.pruned) == {32}


def test_a_near_miss_prunes_its_bucket_only_and_the_next_is_judged_against_the_same_eager_chunk(monkeypatch):
    """The 27B server of session 25 that pruned 32 (bench/RESULTS.md), ms as logged: the
    32-row replay (19.63) is 0.09 ms behind the eager 16-row chunk (19.54), so 32 is pruned;
    64's replay (18.66, another server of that call: this one captured nothing above 32), with
    twice the rows, beats that same eager chunk and is kept (the off-grid warm turn's 51-row
    chunk replays instead of launching eagerly: 19.3 against 21 ms); 128's replay (27.53) is
    1.38x the eager 64-row chunk, past PRUNE_STOP: 128 is pruned and nothing above it is
    captured. The code before stopped at 32 and kept only (16,)."""
    ms = 1e-3
    timings = {16: (19.54 * ms, 17.42 * ms), 32: (20.73 * ms, 19.63 * ms), 64: (19.98 * ms, 18.66 * ms),
               128: (28.61 * ms, 27.53 * ms), 256: RuntimeError("not captured"), 512: RuntimeError("not captured"),
               1024: RuntimeError("not captured")}
    log = []
    monkeypatch.setattr(graphs, "_driver", _Driver(log))
    g = _Captures(graphs.BUCKETS, timings)
    g.prepare(prune=True)
    assert g.buckets == (16, 64)
    assert g.pruned == {32: "its replay took 19.63 ms, the eager chunk of 16 rows 19.54 ms",
                        128: "its replay took 27.53 ms, the eager chunk of 64 rows 19.98 ms",
                        256: "above 128", 512: "above 128", 1024: "above 128"}
    assert log == ["exec 32", "graph 32", "exec 128", "graph 128"] and not g.failed
    assert set(g.seconds) == {16, 32, 64, 128}
    assert g.bucket(17) == 64 and g.bucket(51) == 64 and g.bucket(65) is None
    # two near misses in a row: each pruned, the walk goes on; a miss at PRUNE_STOP exactly stops it
    g = _Captures((16, 32, 64, 128, 256, 512), {16: (10 * ms, 8 * ms), 32: (12 * ms, 10.5 * ms), 64: (14 * ms, 10.9 * ms),
                                                128: (15 * ms, 9.9 * ms), 256: (20 * ms, graphs.PRUNE_STOP * 15 * ms),
                                                512: RuntimeError("not captured")})
    g.prepare(prune=True)
    assert g.buckets == (16, 128) and not g.failed
    assert g.pruned == {32: "its replay took 10.50 ms, the eager chunk of 16 rows 10.00 ms",
                        64: "its replay took 10.90 ms, the eager chunk of 16 rows 10.00 ms",
                        256: "its replay took 16.50 ms, the eager chunk of 128 rows 15.00 ms", 512: "above 256"}


def test_median_seconds_times_each_run_until_the_device_is_done(monkeypatch):
    """TIMED_RUNS runs, each timed through its stream's synchronize: the median of them
    (a fake clock that the device's waits advance: 30, 1 and 10 ms)."""
    now = [0.0]
    waits = iter([0.030, 0.001, 0.010])

    class Stream:
        def synchronize(self):
            now[0] += next(waits)

    monkeypatch.setattr(graphs.time, "perf_counter", lambda: now[0])
    assert graphs.TIMED_RUNS == 3
    assert graphs._median_seconds(lambda: None, Stream()) == pytest.approx(0.010)  # the middle one, not the mean
