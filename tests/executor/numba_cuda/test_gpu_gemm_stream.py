"""The streaming GEMM (gemm_stream.py, gemm_stream.cu) on a real GPU: values against float64 on
the bf16 inputs, outputs poisoned before the launch (none left unwritten), and every variant's
rows bit-equal to the pinned cuBLASLt algorithm's rows of an M = 2048 product at 1, 16, 17, 51
and 64 rows
(the finding of bench/gemm_short.py, session 13: a kernel of ours can stand in for cuBLASLt
without moving a bit). Marked `cuda`: the CUDA simulator cannot run linked CUDA C++, so these
skip without a GPU (test_gemm_stream_emulated.py runs the source on a host emulator in CI).
"""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from executor.numba_cuda import gemm_stream  # noqa: E402
from executor.numba_cuda.device import poisoned, to_device  # noqa: E402
from executor.numba_cuda.gemm import REFERENCE_ROWS, Gemm  # noqa: E402

SHAPES = ((1024, 2048), (2056, 1024), (384, 6144))
"""(N, K): the 2B kv_proj, an N that no CTA width divides, a long K."""


def _bf16(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def gemm():
    return Gemm()


@pytest.mark.parametrize("n, k", SHAPES)
def test_rows_equal_the_pinned_cublaslt_rows_bit_for_bit(gemm, n, k):
    rng = np.random.default_rng(n + k)
    x, w = _bf16(rng, (REFERENCE_ROWS, k)), _bf16(rng, (n, k))
    dx, dw = to_device(x), to_device(w)
    ref = gemm.matmul(dx, dw).copy_to_host()
    want = _f64(x[-64:]) @ _f64(w).T
    for variant in gemm_stream.VARIANTS:
        if not variant.fits(n, k):
            continue
        for m in (1, 16, 17, 51, 64):
            with poisoned():
                got = gemm_stream.matmul(dx[REFERENCE_ROWS - m :], dw, variant).copy_to_host()
            assert np.isfinite(got).all(), f"{variant.label()} left outputs unwritten at M={m}"
            err = np.abs(got - want[64 - m :]).max() / np.abs(want).max()
            assert err < 1e-5, (variant.label(), m, err)
            np.testing.assert_array_equal(got, ref[REFERENCE_ROWS - m :], err_msg=f"{variant.label()} at M={m}")


def test_bad_arguments_name_the_field():
    x, w = to_device(np.zeros((65, 64), np.uint16)), to_device(np.zeros((8, 64), np.uint16))
    with pytest.raises(ValueError, match="rows"):
        gemm_stream.matmul(x, w, gemm_stream.VARIANTS[0])
    with pytest.raises(ValueError, match="K must be a positive multiple"):  # K = 48: not a multiple of the K tile
        gemm_stream.matmul(to_device(np.zeros((4, 48), np.uint16)), to_device(np.zeros((8, 48), np.uint16)),
                           gemm_stream.VARIANTS[0])
