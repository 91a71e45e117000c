"""Kernel cases of the tensor-core prefill attention (attention_mm.py: cuBLASLt QK^T and PV
around numba softmax kernels) against the NumPy twins: values, row invariance across
chunks, tiles and tails, and every output written. Run under the CUDA simulator (the two
GEMMs then run in NumPy) or on a GPU (cuBLASLt with the pinned algorithms); outputs poisoned.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from executor.numba_cuda import attention_mm
from executor.numba_cuda.attention_mm import MatrixAttention, tile_rows
from executor.numba_cuda.device import poisoned, to_device
from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import as_f32, bf16, host, rng
from tests.helpers import assert_close

TOL = 8e-3  # bf16 output against the float64 twin


def _ref(q, qg, k, v, start):
    rows, heads, head_dim = q.shape
    out = ops.attention(q, k, v, start).reshape(rows, -1)
    gate = qg.reshape(rows, heads, 2 * head_dim)[:, :, head_dim:].reshape(rows, -1)
    return ops.sigmoid_gate(out, gate)


def _emulated(q, qg, k, v, start):
    """The serving format's roundings (q and P in bf16, the sum over the rounded P) in float64."""
    rows, heads, head_dim = q.shape
    group = heads // k.shape[1]
    qb = as_f32(bf16(q)).astype(np.float64)
    out = np.empty((rows, heads, head_dim))
    for i in range(rows):
        keys = start + i + 1
        for h in range(heads):
            s = (k[:keys, h // group].astype(np.float64) @ qb[i, h]).astype(np.float32) * np.float32(head_dim**-0.5)
            p = as_f32(bf16(np.exp(s - s.max()))).astype(np.float64)
            out[i, h] = (p @ v[:keys, h // group]) / p.sum()
    gate = qg.reshape(rows, heads, 2 * head_dim)[:, :, head_dim:].astype(np.float64)
    return (out / (1 + np.exp(-gate))).reshape(rows, -1)


def _setup(r, heads=4, kv_heads=2, head_dim=16, capacity=256, slots=2):
    kh = bf16(r.normal(size=(slots, capacity, kv_heads, head_dim)))
    vh = bf16(r.normal(size=(slots, capacity, kv_heads, head_dim)))
    return kh, vh, to_device(kh), to_device(vh)


def _run(mat, q, qg, kc, vc, slot, start, budget=attention_mm.TILE_BYTES):
    with poisoned():
        out = mat.prefill(to_device(q), to_device(qg), kc, vc, slot, start, budget=budget)
    return host(out)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32), (3, 3, 8)])
def test_matrix_attention_matches_twins(heads, kv_heads, head_dim):
    r = rng()
    kh, vh, kc, vc = _setup(r, heads, kv_heads, head_dim)
    start, rows = 9, 13
    q = r.normal(size=(rows, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    out = as_f32(_run(MatrixAttention(), q, qg, kc, vc, 1, start))
    k, v = as_f32(kh[1]), as_f32(vh[1])
    assert_close("vs float64 twin", _ref(q, qg, k, v, start), out, TOL, rel=True)
    assert_close("vs emulated roundings", _emulated(q, qg, k, v, start).astype(np.float32), out, 8e-3, rel=True)


def test_matrix_attention_rows_invariant_across_chunks_tiles_and_tails():
    """A row's bits do not depend on the chunk it sits in, the tile it falls in (a tiny
    scratch budget forces 64-row tiles), or a tail that drops the rows before it."""
    r = rng()
    heads, kv_heads, head_dim = 2, 1, 8
    _, _, kc, vc = _setup(r, heads, kv_heads, head_dim, slots=1)
    rows = 72
    q = r.normal(size=(rows, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    mat = MatrixAttention()
    whole = _run(mat, q, qg, kc, vc, 0, 0)
    pieces = np.concatenate([_run(mat, q[a:b], qg[a:b], kc, vc, 0, a) for a, b in ((0, 64), (64, 72))])
    np.testing.assert_array_equal(pieces, whole)
    small = heads * 64 * 256 * 6  # S and P of 64 rows at 256 padded keys: tiles of 64 rows
    assert tile_rows(rows, heads, rows, small) == 64
    np.testing.assert_array_equal(_run(mat, q, qg, kc, vc, 0, 0, budget=small), whole)
    tail = _run(mat, q[67:], qg[67:], kc, vc, 0, 67)
    np.testing.assert_array_equal(tail, whole[67:])


def test_matrix_attention_other_slot_untouched_and_rejects_bad_shapes():
    r = rng()
    kh, _, kc, vc = _setup(r, 4, 2, 16)
    mat = MatrixAttention()
    q = r.normal(size=(5, 4, 16)).astype(np.float32)
    qg = r.normal(size=(5, 4 * 32)).astype(np.float32)
    _run(mat, q, qg, kc, vc, 1, 3)
    np.testing.assert_array_equal(kc.copy_to_host(), kh)
    with pytest.raises(ValueError, match="qg"):
        mat.prefill(to_device(q), to_device(qg[:, :-1].copy()), kc, vc, 1, 3)
    with pytest.raises(ValueError, match="rows"):  # rows [252, 257): 512 padded keys > 256 cache rows
        mat.prefill(to_device(q), to_device(qg), kc, vc, 1, 252)


def test_tile_rows_fits_the_budget():
    # 9B at a 32K prompt: 16 query heads x 32768 keys x 6 bytes = 3 MiB per row -> 640 rows in 2 GiB
    assert attention_mm.padded(57) == 256 and attention_mm.padded(512) == 512
    assert tile_rows(4096, 16, 32768) == 640
    assert tile_rows(4096, 16, 32768) * 16 * 32768 * 6 <= attention_mm.TILE_BYTES
    assert tile_rows(100, 16, 1000) == 100
    assert tile_rows(4096, 24, 1 << 22) == 64  # never below 64 rows
    assert math.gcd(tile_rows(4096, 24, 8192), 64) == 64


def test_device_pool_size_classes():
    from executor.numba_cuda.device import _size_class

    assert [_size_class(n) for n in (1, 512, 513, 65536)] == [512, 512, 1024, 65536]
    assert _size_class(65537) == 81920 and _size_class(1 << 20) == 1 << 20
    assert all(n <= _size_class(n) <= 1.25 * n + 512 for n in (70_000, 123_456_789, 570_000_000))


def test_prefill_attention_choice_and_flash_input_errors():
    """The backend's choice: the fused kernel where it runs, else this matrix path (under the
    simulator: no NVRTC, so "matrix", the reason kept); the fused kernel's wrapper names bad
    input before any compile."""
    import types

    from executor.numba_cuda import attention_flash
    from executor.numba_cuda.backend import NumbaCudaBackend
    from executor.numba_cuda.device import IS_SIMULATOR

    stub = types.SimpleNamespace(config=types.SimpleNamespace(head_dim=16), matrix_attention=MatrixAttention(),
                                 attention_failures={})
    chosen = NumbaCudaBackend._choose_prefill_attention(stub)
    if IS_SIMULATOR:
        assert chosen == "matrix" and "simulator" in stub.attention_failures["flash"]
        assert "simulator" in attention_flash.unavailable(256)
    else:
        assert chosen == "flash", stub.attention_failures
        assert "head_dim 48" in attention_flash.unavailable(48)
    with pytest.raises(ValueError, match="head_dim 24"):
        attention_flash.kernel(24)
    stub._prefill_attention, stub._prefilled = chosen, True
    with pytest.raises(ValueError, match="prefill attention 'fast'"):
        NumbaCudaBackend.set_prefill_attention(stub, "fast")
    with pytest.raises(ValueError, match="a prefill ran"):  # states already computed keep their path's bits
        NumbaCudaBackend.set_prefill_attention(stub, "cuda-core")
    NumbaCudaBackend.set_prefill_attention(stub, "cuda-core", after_prefill=True)  # benchmarks only
    assert stub._prefill_attention == "cuda-core"
    if IS_SIMULATOR:
        with pytest.raises(ValueError, match="flash prefill attention is unavailable: the CUDA simulator"):
            NumbaCudaBackend.set_prefill_attention(stub, "flash", after_prefill=True)
    r = rng()
    _, _, kc, vc = _setup(r, 4, 2, 16, capacity=256)
    q = to_device(r.normal(size=(5, 4, 16)).astype(np.float32))
    qg = r.normal(size=(5, 4 * 32)).astype(np.float32)
    with pytest.raises(ValueError, match="qg"):
        attention_flash.prefill(q, to_device(qg[:, :-1].copy()), kc, vc, 1, 3)
    with pytest.raises(ValueError, match="capacity 256"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 1, 252)
    with pytest.raises(ValueError, match="slot 2"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 2, 0)
    with pytest.raises(ValueError, match="start must be >= 0"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 1, -1)
    with pytest.raises(ValueError, match="out"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 1, 3, out=to_device(np.zeros((5, 63), np.uint16)))
    with pytest.raises(ValueError, match=r"keys 7 must lie in \[start \+ rows, capacity\] = \[8, 256\]"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 1, 3, keys=7)
    with pytest.raises(ValueError, match="keys 257"):
        attention_flash.prefill(q, to_device(qg), kc, vc, 1, 3, keys=257)
    if IS_SIMULATOR:
        with pytest.raises(RuntimeError, match="simulator"):
            attention_flash.prefill(q, to_device(qg), kc, vc, 1, 3)
