"""The C++ residual add + RMSNorm (norms.add_rms_norm on a GPU, rms_norm.cu) on a real GPU:
values against the float64 twin, the residual updated exactly, every output element
written, and a row's bits independent of the rows beside it. Marked `cuda`: the simulator
cannot run linked CUDA C++, so these skip without a GPU (numba's kernel, which the
simulator runs, is tested in cases_pointwise.py)."""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from executor.numba_cuda import norms  # noqa: E402
from executor.numba_cuda.device import poisoned, to_device  # noqa: E402
from executor.reference import ops  # noqa: E402
from tests.executor.numba_cuda.cases_pointwise import BF16_TOL  # noqa: E402
from tests.executor.numba_cuda.kernel_support import as_f32, host, rng  # noqa: E402
from tests.helpers import assert_close  # noqa: E402


def _norm(x, weight, delta, threads):
    dx = to_device(x)
    with poisoned():
        out = host(norms.add_rms_norm(dx, to_device(weight), 1e-6, delta=None if delta is None else to_device(delta),
                                      threads=threads))
    return out, dx.copy_to_host()


@pytest.mark.parametrize("threads", [256, 1024])
@pytest.mark.parametrize("dim", [8, 200, 2048, 4096, 5120])
@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "residual"])
def test_fused_norm_matches_the_twin(threads, dim, with_delta):
    assert norms.fused_unavailable(dim, threads) is None
    r = rng()
    x = r.normal(size=(7, dim)).astype(np.float32)
    delta = r.normal(size=(7, dim)).astype(np.float32) if with_delta else None
    weight = r.normal(0, 0.1, dim).astype(np.float32)
    out, residual = _norm(x, weight, delta, threads)
    summed = x + delta if with_delta else x
    np.testing.assert_array_equal(residual, summed)
    assert_close("fused add_rms_norm", ops.rms_norm(summed, weight, 1e-6), as_f32(out), BF16_TOL, rel=True)


@pytest.mark.parametrize("threads", [256, 1024])
def test_fused_norm_rows_do_not_depend_on_the_chunk(threads):
    """Rows of a 300-row call equal the same rows normed alone, in a 51-row call and in a
    one-row call (bits of the output and of the updated residual)."""
    r = rng()
    dim = 5120
    x = r.normal(size=(300, dim)).astype(np.float32)
    delta = r.normal(size=(300, dim)).astype(np.float32)
    weight = r.normal(0, 0.1, dim).astype(np.float32)
    whole, whole_residual = _norm(x, weight, delta, threads)
    for a, b in ((0, 1), (249, 300), (137, 138)):
        part, part_residual = _norm(x[a:b].copy(), weight, delta[a:b].copy(), threads)
        np.testing.assert_array_equal(part, whole[a:b])
        np.testing.assert_array_equal(part_residual, whole_residual[a:b])


def test_fused_norm_differs_from_numba_s_only_by_rounding():
    """The two kernels sum in different orders: outputs within bf16 rounding of each other
    (a backend keeps one: `fused` defaults by the GPU, dim and threads)."""
    r = rng()
    x = r.normal(size=(5, 2048)).astype(np.float32)
    weight = r.normal(0, 0.1, 2048).astype(np.float32)
    with poisoned():
        fused = host(norms.add_rms_norm(to_device(x), to_device(weight), 1e-6, threads=256, fused=True))
        plain = host(norms.add_rms_norm(to_device(x), to_device(weight), 1e-6, threads=256, fused=False))
    assert_close("fused vs numba", as_f32(plain), as_f32(fused), BF16_TOL, rel=True)


def test_fused_norm_rejects_what_it_cannot_read():
    x = to_device(np.zeros((2, 16), np.float32))
    weight = to_device(np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="C-contiguous and 16-byte aligned"):
        norms.add_rms_norm(x[:, 4:], to_device(np.zeros(12, np.float32)), 1e-6, threads=256, fused=True)
    with pytest.raises(ValueError, match="dim 6"):
        norms.add_rms_norm(to_device(np.zeros((2, 6), np.float32)), to_device(np.zeros(6, np.float32)), 1e-6,
                           threads=256, fused=True)
    assert "threads 32" in norms.fused_unavailable(16, 32)
    norms.add_rms_norm(x, weight, 1e-6, threads=256, fused=True)  # aligned: runs
