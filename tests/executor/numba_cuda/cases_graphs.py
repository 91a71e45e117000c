"""Host side of the captured prefill chunks (graphs.PrefillGraphs): the bucket a chunk runs
in and the padded input layout its kernels read. Run by test_kernels_simulated.py under
the CUDA simulator (no graphs there: the replays are tested in test_gpu_prefill_graphs.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda import graphs


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [graphs.bucket_for(graphs.BUCKETS, n) for n in (1, 16, 17, 64, 65, 256, 257)] == [
        16, 16, 32, 64, 128, 256, None]


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


def test_buckets_are_checked_against_the_capacity():
    assert graphs.check_buckets([64, 16, 16, np.int64(32)], 64) == (16, 32, 64)
    assert graphs.check_buckets([20], 32) == (20,)  # its keys are read up to 32: fits
    for bad in ([], [0, 16], [16.5], ["16"], [33]):
        with pytest.raises(ValueError, match="buckets"):
            graphs.check_buckets(bad, 32)
