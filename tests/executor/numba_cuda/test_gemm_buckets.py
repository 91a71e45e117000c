"""The cuBLASLt buckets without a GPU (executor/numba_cuda/gemm.py): how many weight copies a
bucket timing cycles over (a weight the L2 cache would hold must be timed from device memory),
which shapes the wide pool asks the heuristic at, and the fallback to the reference algorithm."""

from __future__ import annotations

import pytest

from executor.numba_cuda.gemm import TIMING_MAX_COPIES, TIMING_WEIGHT_BYTES, timing_copies


@pytest.mark.parametrize(("n", "k", "copies"), [
    (2048, 5120, 13),     # 27B kv_proj, 21 MB: 13 copies hold 273 MB
    (5120, 6144, 5),      # 27B o_proj and out_proj, 63 MB
    (34816, 5120, 1),     # 27B gate_up, 357 MB: itself
    (5120, 17408, 2),     # 27B down_proj, 178 MB
    (1024, 2048, 16),     # a 2B-sized product, 4 MB: capped
])
def test_timing_copies_hold_the_timing_bytes(n, k, copies):
    assert timing_copies(n * k * 2) == copies
    assert copies == TIMING_MAX_COPIES or copies * n * k * 2 >= TIMING_WEIGHT_BYTES


def test_timing_copies_refuses_an_empty_weight():
    with pytest.raises(ValueError, match="weight_bytes"):
        timing_copies(0)


def test_pool_queries_ask_the_bucket_shape_first_then_wider_and_narrower_ones():
    """The wide pool's heuristic queries (session 17's search found the 27B winners at
    (51, 3N) for down_proj and (16, 4N) for kv_proj): the bucket's own shape first, then every
    M' of POOL_ROWS and the top M with every whole multiple-of-8 N' of POOL_COLUMNS, once."""
    from executor.numba_cuda.gemm import POOL_COLUMNS, POOL_ROWS, pool_queries

    queries = pool_queries(5120, 64)
    assert queries[0] == (64, 5120)
    assert len(queries) == len(set(queries)) == (len(POOL_ROWS) + 1) * len(POOL_COLUMNS)
    assert {(48, 15360), (16, 20480), (1, 1280), (64, 2560)} <= set(queries)
    assert {m for m, _ in queries} == {*POOL_ROWS, 64}
    # N' must be a whole multiple of 8: 2056 / 4 = 514 and 2056 / 2 = 1028 are not
    odd = pool_queries(2056, 16)
    assert all(nq % 8 == 0 for _, nq in odd)
    assert {nq for _, nq in odd} == {2056, 4112, 6168, 8224}


def test_pool_takes_each_querys_first_candidates_once_and_skips_refused_shapes():
    """Gemm.pool without a GPU (the heuristic replaced): the bucket's own query first, at most
    BUCKET_CANDIDATES from each query, an algorithm offered twice kept once, a query the
    heuristic refuses skipped; buckets past WIDE_POOL_MAX_ROWS ask their own shape only."""
    import numpy as np

    from executor.numba_cuda.gemm import BUCKET_CANDIDATES, WIDE_POOL_MAX_ROWS, Gemm, pool_queries

    asked = []

    def candidates(n, k, m):
        asked.append((m, n))
        if n == 2 * 1024:
            raise RuntimeError("refused")
        # ten algorithms a query; ids 0-4 are offered by every query
        return [np.full(8, i if i < 5 else 1000 * m + n + i, np.uint64) for i in range(10)]

    gemm = Gemm.__new__(Gemm)
    gemm._candidates = candidates
    pool = gemm.pool(1024, 64, 64)
    assert asked == pool_queries(1024, 64)
    ids = [int(a[0]) for a in pool]
    assert ids[:BUCKET_CANDIDATES] == [0, 1, 2, 3, 4, 64 * 1000 + 1024 + 5, 64 * 1000 + 1024 + 6, 64 * 1000 + 1024 + 7]
    answered = len(asked) - sum(1 for _, n in asked if n == 2048)
    assert len(ids) == len(set(ids)) == 5 + answered * (BUCKET_CANDIDATES - 5)
    asked.clear()
    assert len(gemm.pool(1024, 64, WIDE_POOL_MAX_ROWS + 1)) == BUCKET_CANDIDATES
    assert asked == [(WIDE_POOL_MAX_ROWS + 1, 1024)]


def test_a_bucket_algorithm_that_refuses_a_row_count_falls_back_to_the_reference(monkeypatch):
    """Gemm.matmul without a GPU (cuBLASLt replaced): when a bucket's algorithm refuses an M its
    probes missed, that M runs the reference (the same bits at every M) from then on, without
    asking the bucket's algorithm again; other Ms keep the bucket's; a refusing reference raises."""
    import numpy as np

    from executor.numba_cuda import gemm as gemm_module

    monkeypatch.setattr(gemm_module, "IS_SIMULATOR", False)
    reference, bucket = np.zeros(8, np.uint64), np.ones(8, np.uint64)
    gemm = gemm_module.Gemm.__new__(gemm_module.Gemm)
    gemm.pinned, gemm.refused = {}, {}
    gemm._algos = {(4, 3): reference}
    gemm._buckets = {(4, 3): [(16, bucket), (64, bucket)]}
    ran = []

    def run(algo, x, w, out, stream=0, accumulate=False):
        m = x.shape[0]
        if (algo is bucket and m == 5) or (algo is reference and m == 7):
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        ran.append((m, "reference" if algo is reference else "bucket") + (("accumulate",) if accumulate else ()))

    gemm._run = run
    w = np.zeros((4, 3), np.uint16)
    for m in (5, 5, 6):
        gemm.matmul(np.zeros((m, 3), np.uint16), w, np.zeros((m, 4), np.float32))
    assert ran == [(5, "reference"), (5, "reference"), (6, "bucket")]
    assert list(gemm.refused) == [(5, 4, 3)] and "NOT_SUPPORTED" in gemm.refused[(5, 4, 3)]
    # an accumulating product falls back the same way, still accumulating, when the bucket's
    # algorithm refused before any launch (NOT_SUPPORTED); after a possible launch it raises
    gemm.accumulates = lambda n, k: True
    monkeypatch.setattr(gemm_module, "device_pointer", lambda array: 0)
    monkeypatch.setattr(gemm_module, "check", lambda *args, **kwargs: None)
    gemm.refused.clear()
    ran.clear()
    for m in (5, 6):
        dev_out = type("Out", (), {"shape": (m, 4), "is_c_contiguous": lambda self: True})()
        gemm.matmul(np.zeros((m, 3), np.uint16), w, dev_out, accumulate=True)
    assert ran == [(5, "reference", "accumulate"), (6, "bucket", "accumulate")]
    assert list(gemm.refused) == [(5, 4, 3)]

    def failed_after_launch(algo, x, w, out, stream=0, accumulate=False):
        if algo is bucket:
            raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")
        ran.append((x.shape[0], "reference"))

    gemm._run = failed_after_launch
    dev_out = type("Out", (), {"shape": (9, 4), "is_c_contiguous": lambda self: True})()
    with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):  # out may hold a partial sum: no second add
        gemm.matmul(np.zeros((9, 3), np.uint16), w, dev_out, accumulate=True)
    assert (9, 4, 3) not in gemm.refused
    gemm.matmul(np.zeros((9, 3), np.uint16), w, np.zeros((9, 4), np.float32))  # not accumulating: falls back
    assert (9, 4, 3) in gemm.refused
    gemm._run = run
    gemm._buckets[(4, 3)] = []  # no buckets: the reference runs M = 7, and refuses it
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        gemm.matmul(np.zeros((7, 3), np.uint16), w, np.zeros((7, 4), np.float32))
    assert (7, 4, 3) not in gemm.refused


def test_a_large_range_algorithm_that_refuses_a_row_count_falls_back_to_the_reference(monkeypatch):
    """The range past the buckets (M > 1024) falls back like a bucket: an M its algorithm refuses
    runs the reference from then on; other large Ms keep the range's algorithm."""
    import numpy as np

    from executor.numba_cuda import gemm as gemm_module

    monkeypatch.setattr(gemm_module, "IS_SIMULATOR", False)
    reference, large = np.zeros(8, np.uint64), np.full(8, 2, np.uint64)
    gemm = gemm_module.Gemm.__new__(gemm_module.Gemm)
    gemm.pinned, gemm.refused, gemm.large = {}, {}, True
    gemm._algos = {(4, 3): reference}
    gemm._buckets = {(4, 3): [(hi, np.ones(8, np.uint64)) for _, hi in gemm_module.BUCKETS] + [(gemm_module.LARGE, large)]}
    ran = []

    def run(algo, x, w, out, stream=0, accumulate=False):
        if algo is large and x.shape[0] == 3000:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        ran.append((x.shape[0], "reference" if algo is reference else "large" if algo is large else "bucket"))

    gemm._run = run
    w = np.zeros((4, 3), np.uint16)
    for m in (3000, 3000, 2000, 1024):
        gemm.matmul(np.zeros((m, 3), np.uint16), w, np.zeros((m, 4), np.float32))
    assert ran == [(3000, "reference"), (3000, "reference"), (2000, "large"), (1024, "bucket")]
    assert list(gemm.refused) == [(3000, 4, 3)]
