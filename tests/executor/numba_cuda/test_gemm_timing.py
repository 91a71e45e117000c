"""How many weight copies a cuBLASLt bucket timing cycles over (executor/numba_cuda/gemm.py),
without a GPU: a weight the L2 cache would hold must be timed from device memory."""

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
