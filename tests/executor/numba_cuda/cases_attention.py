"""Kernel cases of causal attention (+ the fused sigmoid output gate) against the NumPy
twins: prefill tiles, row invariance across chunkings, and decode lanes with several
splits. Run under the CUDA simulator or on a GPU; outputs poisoned.
"""

from __future__ import annotations

import numpy as np

from executor.numba_cuda import attention
from executor.numba_cuda.device import poisoned, to_device
from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import as_f32, bf16, host, rng
from tests.helpers import assert_close

TOL = 8e-3  # bf16 output


def _cache(r, slots, capacity, kv_heads, head_dim):
    return bf16(r.normal(size=(slots, capacity, kv_heads, head_dim))), bf16(r.normal(size=(slots, capacity, kv_heads, head_dim)))


def _run(q, qg, slots, positions, kc, vc, tile_rows, split_rows, max_pos=None):
    with poisoned():
        out = attention.attention(
            to_device(q), to_device(np.asarray(slots, np.int32)), to_device(np.asarray(positions, np.int32)),
            int(max(positions)) if max_pos is None else max_pos, kc, vc, to_device(qg), tile_rows, split_rows,
        )
    return host(out)


def _ref(q, qg, k, v, start):
    rows, heads, head_dim = q.shape
    out = ops.attention(q, k, v, start).reshape(rows, -1)
    gate = qg.reshape(rows, heads, 2 * head_dim)[:, :, head_dim:].reshape(rows, -1)
    return ops.sigmoid_gate(out, gate)


def test_prefill_attention_matches_twin_and_is_row_invariant():
    r = rng()
    heads, kv_heads, head_dim, start, rows = 4, 2, 16, 5, 11
    kh, vh = _cache(r, 2, 20, kv_heads, head_dim)
    kc, vc = to_device(kh), to_device(vh)
    q = r.normal(size=(rows, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    positions = np.arange(start, start + rows)
    out = _run(q, qg, [1] * rows, positions, kc, vc, attention.TILE_ROWS, attention.PREFILL_SPLIT_ROWS)
    ref = _ref(q, qg, as_f32(kh[1]), as_f32(vh[1]), start)
    assert_close("prefill attention", ref, as_f32(out), TOL, rel=True)
    tail = _run(q[7:], qg[7:], [1] * (rows - 7), positions[7:], kc, vc, attention.TILE_ROWS, attention.PREFILL_SPLIT_ROWS)
    np.testing.assert_array_equal(tail, out[7:])


def test_decode_attention_lanes_with_splits():
    r = rng()
    heads, kv_heads, head_dim = 2, 1, 16
    kh, vh = _cache(r, 3, 12, kv_heads, head_dim)
    kc, vc = to_device(kh), to_device(vh)
    slots, positions = [2, 0], [9, 3]
    q = r.normal(size=(2, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(2, heads * 2 * head_dim)).astype(np.float32)
    out = _run(q, qg, slots, positions, kc, vc, 1, 4)
    for lane, (slot, pos) in enumerate(zip(slots, positions)):
        ref = _ref(q[lane : lane + 1], qg[lane : lane + 1], as_f32(kh[slot]), as_f32(vh[slot]), pos)
        assert_close(f"lane {lane}", ref, as_f32(out[lane : lane + 1]), TOL, rel=True)
    solo = _run(q[1:], qg[1:], slots[1:], positions[1:], kc, vc, 1, 4)
    np.testing.assert_array_equal(solo[0], out[1])


def test_decode_attention_grouped_heads_any_split_grid():
    """Three query heads per K/V head, 64 dims (two per lane), several keys per warp and
    split: matches the twin, and a split grid sized for a larger max_pos (as a CUDA graph
    sizes it: here 4 splits of 16 keys for max_pos 63, against 3 for the lanes' 37) gives
    the same bits. (Until session 42 the second grid was sized for max_pos 47, which makes
    the same 3 splits: the check could not fail. One K/V head, not two, halves its cost
    under the simulator.)"""
    r = rng()
    heads, kv_heads, head_dim, split_rows = 3, 1, 64, 16
    kh, vh = _cache(r, 2, 64, kv_heads, head_dim)
    kc, vc = to_device(kh), to_device(vh)
    slots, positions = [1, 0, 1], [37, 5, 20]
    q = r.normal(size=(3, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(3, heads * 2 * head_dim)).astype(np.float32)
    out = _run(q, qg, slots, positions, kc, vc, 1, split_rows)
    for lane, (slot, pos) in enumerate(zip(slots, positions)):
        ref = _ref(q[lane : lane + 1], qg[lane : lane + 1], as_f32(kh[slot]), as_f32(vh[slot]), pos)
        assert_close(f"lane {lane}", ref, as_f32(out[lane : lane + 1]), TOL, rel=True)
    assert (max(positions) // split_rows + 1, 63 // split_rows + 1) == (3, 4)  # the two grids differ
    np.testing.assert_array_equal(out, _run(q, qg, slots, positions, kc, vc, 1, split_rows, max_pos=63))


def test_decode_rejects_what_its_loads_cannot_serve():
    """Decode reads 8 dimensions per 16-byte load and keeps a split's scores in shared memory:
    a head_dim not a multiple of 8, or a split over MAX_DECODE_SPLIT_ROWS, is a ValueError
    naming it, before any launch."""
    import pytest

    r = rng()
    kh, vh = _cache(r, 1, 8, 1, 12)
    q = r.normal(size=(1, 2, 12)).astype(np.float32)
    qg = r.normal(size=(1, 2 * 2 * 12)).astype(np.float32)
    with pytest.raises(ValueError, match=r"head_dim % 8 == 0 \(got 12\)"):
        _run(q, qg, [0], [3], to_device(kh), to_device(vh), 1, 4)
    kh, vh = _cache(r, 1, 8, 1, 16)
    q = r.normal(size=(1, 2, 16)).astype(np.float32)
    qg = r.normal(size=(1, 2 * 2 * 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"split_rows in \[1, 256\] \(got 257\)"):
        _run(q, qg, [0], [3], to_device(kh), to_device(vh), 1, attention.MAX_DECODE_SPLIT_ROWS + 1)


def test_decode_attention_combines_more_splits_than_it_loads_at_once():
    """A lane with more splits than COMBINE_IN_FLIGHT (6 splits of 4 keys): the combine's batched
    loads and its tail both run (the other cases have at most 3 splits; a review planted
    `weights[i]` for `weights[i + u]` in the batched loop and no test failed)."""
    r = rng()
    heads, kv_heads, head_dim = 2, 1, 16
    kh, vh = _cache(r, 1, 24, kv_heads, head_dim)
    position = 21
    assert position // 4 + 1 > attention.COMBINE_IN_FLIGHT
    q = r.normal(size=(1, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(1, heads * 2 * head_dim)).astype(np.float32)
    out = _run(q, qg, [0], [position], to_device(kh), to_device(vh), 1, 4)
    ref = _ref(q, qg, as_f32(kh[0]), as_f32(vh[0]), position)
    assert_close("lane 0", ref, as_f32(out), TOL, rel=True)
