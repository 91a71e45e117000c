"""Output projections added into the residual stream (Gemm.matmul(..., accumulate=True) and
NumbaCudaBackend._into_residual). Run by test_kernels_simulated.py under the CUDA simulator
(NumPy stands in for cuBLASLt); `pytest tests/executor/numba_cuda/cases_residual.py` on a GPU
runs the same cases on cuBLASLt's epilogue, where they assert its bits equal the separate
fp32 add's."""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda import gemm as gemm_module
from executor.numba_cuda.device import empty, to_device
from executor.numba_cuda.gemm import Gemm
from tests.executor.numba_cuda.kernel_support import host, rng


def _bf16(r, shape):
    return (r.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("m", [1, 5, 51, 300])
def test_accumulate_adds_the_product_into_out_in_fp32(m):
    """out += x @ w.T gives the bits of numpy's fp32 out + (the same product alone), on a row
    slice of a larger array too (the backend adds the tail's rows into x[first:])."""
    r = rng()
    n, k = 64, 96
    gemm = Gemm()
    x, w = to_device(_bf16(r, (m, k))), to_device(_bf16(r, (n, k)))
    assert gemm.accumulates(n, k), gemm.pinned.get((n, k))
    product = host(gemm.matmul(x, w))
    residual = (r.standard_normal((m + 8, n)) * np.exp2(r.integers(-10, 10, (m + 8, n)))).astype(np.float32)
    residual[8::3] = -product[::3]  # exact cancellations: +0, as the add gives
    out = to_device(residual)
    got = gemm.matmul(x, w, out=out[8:], accumulate=True)
    expected = residual.copy()
    expected[8:] = residual[8:] + product
    np.testing.assert_array_equal(host(out).view(np.uint32), expected.view(np.uint32))
    assert got.shape == (m, n)


def test_accumulate_refuses_a_missing_or_wrong_out():
    r = rng()
    gemm = Gemm()
    x, w = to_device(_bf16(r, (4, 32))), to_device(_bf16(r, (16, 32)))
    with pytest.raises(ValueError, match="accumulate needs out"):
        gemm.matmul(x, w, accumulate=True)
    with pytest.raises(ValueError, match="out"):
        gemm.matmul(x, w, out=to_device(np.zeros((5, 16), np.float32)), accumulate=True)
    with pytest.raises(ValueError, match="out"):
        gemm.matmul(x, w, out=to_device(np.zeros((4, 16), np.float64)), accumulate=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm.matmul(x, w, out=to_device(np.zeros((4, 32), np.float32))[:, :16], accumulate=True)


def _fake_gemm(plant: str | None) -> Gemm:
    """A Gemm whose algorithms are NumPy products; `plant` breaks the accumulating one: "ulp"
    moves one element by one unit in the last place, "raise" refuses beta = 1."""
    gemm = Gemm.__new__(Gemm)
    gemm.pinned, gemm.refused, gemm._accumulate = {(16, 32): {}}, {}, {}
    reference, bucket = np.zeros(8, np.uint64), np.ones(8, np.uint64)
    gemm._algos = {(16, 32): reference}
    gemm._buckets = {(16, 32): [(16, bucket), (64, bucket)]}

    def run(algo, x, w, out, stream=0, accumulate=False):
        xs = host(x).astype(np.uint32) << 16
        ws = host(w).astype(np.uint32) << 16
        p = (xs.view(np.float32).astype(np.float64) @ ws.view(np.float32).T.astype(np.float64)).astype(np.float32)
        if not accumulate:
            out.copy_to_device(p)
            return
        if plant == "raise" and algo is bucket:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        got = host(out) + p
        if plant == "ulp" and algo is bucket and x.shape[0] == 64:
            got.reshape(-1)[7] = np.nextafter(got.reshape(-1)[7], np.float32(np.inf))
        out.copy_to_device(got)

    gemm._run = run
    return gemm


@pytest.mark.parametrize(("plant", "why"), [(None, ""), ("ulp", "at M=64: 1 of 1024 elements differ"),
                                            ("raise", "at M=16: RuntimeError")])
def test_pin_checks_every_algorithm_accumulates_exactly(plant, why):
    """`_accumulate_failure` runs the reference at ACCUMULATE_PROBE_ROWS and each bucket's
    algorithm at its top M, and names the first that gives other bits or refuses beta = 1."""
    r = rng()
    gemm = _fake_gemm(plant)
    x = to_device(_bf16(r, (gemm_module.REFERENCE_ROWS, 32)))
    w = to_device(_bf16(r, (16, 32)))
    got = gemm._accumulate_failure((16, 32), x, w, np.random.default_rng(1))
    assert (got == "") if not why else (why in got), got


class _Gemm:
    def __init__(self, refuse: bool):
        self.refuse, self.calls, self.pinned = refuse, [], {(8, 4): {"accumulate": "algo 7 at M=1: differ"}}

    def accumulates(self, n, k):
        self.calls.append(("accumulates", n, k))
        return not self.refuse

    def matmul(self, a, weight, out=None, stream=0, accumulate=False):
        self.calls.append(("matmul", accumulate))
        return out


def _stub(on: bool, refuse: bool = False):
    from executor.numba_cuda.backend import NumbaCudaBackend

    stub = NumbaCudaBackend.__new__(NumbaCudaBackend)
    stub.residual_accumulate, stub.accumulate_refused, stub.gemm = on, {}, _Gemm(refuse)
    return stub


def test_into_residual_adds_in_prefill_and_hands_the_product_on_otherwise():
    """Prefill adds into x (None back); decode (the GEMV), the switch off, a refused shape (kept
    refused without asking again) and rows not 256-byte aligned hand the product to the norm."""
    a, weight = np.zeros((3, 4), np.uint16), np.zeros((8, 4), np.uint16)
    x = empty((4, 8), np.float32)
    stub = _stub(True)
    product = []

    def mm(a, weight, stream=0):
        product.append(a.shape[0])
        return "product"

    assert stub._into_residual(a, weight, x, stub.gemm.matmul, 0) is None
    assert stub.gemm.calls == [("accumulates", 8, 4), ("matmul", True)]
    assert stub._into_residual(a, weight, x, mm, 0) == "product"  # decode: the GEMV
    off = _stub(False)
    off.gemm.matmul = lambda a, weight, out=None, stream=0, accumulate=False: ("alone", accumulate)
    assert off._into_residual(a, weight, x, off.gemm.matmul, 0) == ("alone", False)
    refused = _stub(True, refuse=True)
    refused.gemm.matmul = lambda a, weight, out=None, stream=0, accumulate=False: ("alone", accumulate)
    for _ in range(2):
        assert refused._into_residual(a, weight, x, refused.gemm.matmul, 0) == ("alone", False)
    assert refused.accumulate_refused == {(8, 4): "algo 7 at M=1: differ"}
    assert refused.gemm.calls == [("accumulates", 8, 4)]  # asked once
    from unittest import mock

    from executor.numba_cuda import backend as backend_module

    with mock.patch.object(backend_module, "accumulate_aligned", lambda array: False):  # a row slice 16 bytes in
        stub = _stub(True)
        stub.gemm.matmul = lambda a, weight, out=None, stream=0, accumulate=False: ("alone", accumulate)
        assert stub._into_residual(a, weight, x, stub.gemm.matmul, 0) == ("alone", False)
    assert product == [3]
