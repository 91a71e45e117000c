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
    moves one element by one unit in the last place at M = 64, "lo" does so at M = 17 only (the
    bucket's lowest row count), "sign" computes -((-p) - c) (c + p but for an exact
    cancellation, -0 for +0), "ftz" flushes subnormal C to zero, "inf" drops an infinite C,
    "large" moves one element at M = 1537 with the range past the buckets' algorithm, "raise"
    refuses beta = 1."""
    gemm = Gemm.__new__(Gemm)
    gemm.pinned, gemm.refused, gemm._accumulate = {(16, 32): {}}, {}, {}
    reference, bucket, large = np.zeros(8, np.uint64), np.ones(8, np.uint64), np.full(8, 2, np.uint64)
    gemm._algos = {(16, 32): reference}
    gemm._buckets = {(16, 32): [(hi, bucket) for _, hi in gemm_module.BUCKETS] + [(gemm_module.LARGE, large)]}

    def run(algo, x, w, out, stream=0, accumulate=False):
        xs = host(x).astype(np.uint32) << 16
        ws = host(w).astype(np.uint32) << 16
        p = (xs.view(np.float32).astype(np.float64) @ ws.view(np.float32).T.astype(np.float64)).astype(np.float32)
        if not accumulate:
            out.copy_to_device(p)
            return
        if plant == "raise" and algo is bucket:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        c = out.copy_to_host()  # holds infinities: not `host`, which refuses non-finite values
        if plant == "ftz":  # an epilogue that flushes subnormal inputs to zero
            c = np.where(np.abs(c) < np.float32(2.0**-126), np.copysign(np.float32(0), c), c)
        got = -((-p) - c) if plant == "sign" else c + p
        if plant == "inf":  # an epilogue that drops an infinite C
            got = np.where(np.isinf(c), p, got)
        if plant == "large" and algo is large and x.shape[0] == 1537:
            got.reshape(-1)[5] = np.nextafter(got.reshape(-1)[5], np.float32(np.inf))
        if (plant == "ulp" and algo is bucket and x.shape[0] == 64) or (plant == "lo" and x.shape[0] == 17):
            got.reshape(-1)[7] = np.nextafter(got.reshape(-1)[7], np.float32(np.inf))
        out.copy_to_device(got)

    gemm._run = run
    return gemm


@pytest.mark.parametrize(("plant", "why"), [(None, ""), ("ulp", "at M=64: 1 of 1024 elements differ"),
                                            ("lo", "at M=17: 1 of 272 elements differ"), ("sign", "elements differ"),
                                            ("ftz", "at M=51: "), ("inf", "at M=51: "),
                                            ("large", "algo 2 at M=1537: 1 of 24592 elements differ"),
                                            ("raise", "at M=1: RuntimeError")])
def test_the_accumulate_check_runs_every_algorithm_at_its_probe_rows(plant, why):
    """`_accumulate_failure` runs the reference at ACCUMULATE_PROBE_ROWS and each bucket's
    algorithm at its range's probe rows, and names the first that gives other bits (one ulp
    at one M, -0 for an exact cancellation, a subnormal C flushed) or refuses beta = 1; `accumulates` keeps the
    verdict and says it in `pinned`."""
    gemm = _fake_gemm(plant)
    got = gemm._accumulate_failure((16, 32), seed=1)
    assert (got == "") if not why else (why in got), got
    gemm.pin = lambda n, k: gemm._algos[(n, k)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemm_module, "IS_SIMULATOR", False)
        assert gemm.accumulates(16, 32) is (not why)
        assert gemm.pinned[(16, 32)]["accumulate"] == (got or "bit-equal")
        gemm._accumulate_failure = None  # asked once a shape
        assert gemm.accumulates(16, 32) is (not why)


def test_matmul_refuses_to_accumulate_a_shape_the_check_refused():
    gemm = _fake_gemm("ulp")
    x, w = to_device(np.zeros((4, 32), np.uint16)), to_device(np.zeros((16, 32), np.uint16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemm_module, "IS_SIMULATOR", False)
        patch.setattr(gemm_module, "device_pointer", lambda array: 512)
        gemm.pin = lambda n, k: gemm._algos[(n, k)]
        with pytest.raises(ValueError, match="does not accumulate exactly: algo 1 at M=64"):
            gemm.matmul(x, w, out=empty((4, 16), np.float32), accumulate=True)
        patch.setattr(gemm_module, "device_pointer", lambda array: 512 + 16)
        with pytest.raises(ValueError, match="256-byte aligned"):
            gemm.matmul(x, w, out=empty((4, 16), np.float32), accumulate=True)


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


def test_forward_adds_each_projection_once_into_its_rows(monkeypatch, tmp_path):
    """`_forward`'s data flow with accumulate on, off, and on with down_proj's shape refused
    (the mixed path): the same last-row logits over a whole chunk, chunks with a tail, and a
    one-row tail. Attention, the norms, SwiGLU and the GEMV are NumPy stand-ins here (the
    real kernels are slow under the simulator; test_gpu_backend.py runs them on a GPU); the
    residual adds are fp32 either way, so a projection added twice, never, into the wrong
    rows, or a last row taken from the wrong array moves the logits."""
    from executor.model import random_checkpoint
    from executor.numba_cuda import backend as backend_module
    from executor.numba_cuda.backend import NumbaCudaBackend
    from executor.safetensors_file import bf16_to_f32
    from executor.weights import load_weights
    from tests.executor.qwen_support import small_config

    def bf16(a):
        return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def linear(self, i, li, h, mm, *args, **kwargs):
        return to_device(np.ascontiguousarray(host(h)[:, : self.config.linear_value_dim]))

    def full(self, i, fi, h, mm, positions, slots, first, *args, **kwargs):
        if first == h.shape[0]:
            return None
        rows = host(h)[first:]
        width = self.config.num_attention_heads * self.config.head_dim
        return to_device(np.ascontiguousarray(np.tile(rows, -(-width // rows.shape[1]))[:, :width]))

    def add_rms_norm(x, weight, eps, delta=None, out=None, stream=0, threads=0, **kwargs):
        xs = host(x)
        if delta is not None:
            assert tuple(delta.shape) == tuple(x.shape), (delta.shape, x.shape)
            xs = xs + host(delta)
            x.copy_to_device(xs)
        return to_device(bf16(xs / np.sqrt((xs * xs).mean(axis=1, keepdims=True) + np.float32(eps)) * host(weight)))

    def swiglu(gate_up, stream=0, **kwargs):
        g = host(gate_up)
        g = bf16_to_f32(g) if g.dtype == np.uint16 else g  # a bf16 gate|up (chunks past 1,024 rows)
        n = g.shape[1] // 2
        return to_device(bf16(g[:, :n] / (1 + np.exp(-g[:, :n])) * g[:, n:]))

    def gemv(h, w, stream=0, **kwargs):
        product = bf16_to_f32(host(h)).astype(np.float64) @ bf16_to_f32(host(w)).T.astype(np.float64)
        return to_device(product.astype(np.float32))

    monkeypatch.setattr(NumbaCudaBackend, "_linear_attention", linear)
    monkeypatch.setattr(NumbaCudaBackend, "_full_attention", full)
    monkeypatch.setattr(backend_module.norms, "add_rms_norm", add_rms_norm)
    monkeypatch.setattr(backend_module.elementwise, "swiglu", swiglu)
    monkeypatch.setattr(backend_module, "gemv", gemv)
    config = small_config()
    backend = NumbaCudaBackend(load_weights(random_checkpoint(config, seed=3, out_dir=tmp_path)), slots=2,
                               capacity_rows=64)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 12)]
    calls = []
    real = backend.gemm.matmul

    def counted(*args, accumulate=False, **kwargs):
        calls.append(accumulate)
        return real(*args, accumulate=accumulate, **kwargs)

    backend.gemm.matmul = counted

    def run(cuts, tail=None):
        state, logits = backend.new_state(), None
        for a, b in zip(cuts, cuts[1:]):
            last = b == cuts[-1]
            logits = backend.prefill(state, ids, (a, b), want_logits=last, tail_from=tail if last else None)
        backend.release(state)
        return np.array(logits)

    plans = (([0, 12], None), ([0, 5, 12], 9), ([0, 12], 11))
    backend.residual_accumulate = False
    off = [run(cuts, tail) for cuts, tail in plans]
    assert True not in calls
    backend.residual_accumulate = True
    on = [run(cuts, tail) for cuts, tail in plans]
    assert calls.count(True) >= 2 * len(config.layer_types)
    n, k = backend.w.layers[0]["down"].shape
    backend.accumulate_refused[(n, k)] = "planted"
    mixed = [run(cuts, tail) for cuts, tail in plans]
    for a, b, c in zip(off, on, mixed):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))


def test_accumulate_aligned_wants_a_256_byte_boundary(monkeypatch):
    monkeypatch.setattr(gemm_module, "IS_SIMULATOR", False)
    for address, aligned in ((0, True), (256, True), (4096 + 256, True), (16, False), (256 + 128, False)):
        monkeypatch.setattr(gemm_module, "device_pointer", lambda array, address=address: address)
        assert gemm_module.accumulate_aligned(object()) is aligned, address
