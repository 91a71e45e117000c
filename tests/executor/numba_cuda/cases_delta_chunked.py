"""Kernel cases of the chunked gated delta rule (delta_chunked.delta_chunked) against the NumPy
twin ops.gated_delta_rule_chunked (also with the other phase-2 block shapes), its
exactness on the 64-row grid (bit-identical outputs and states for any chunking whose cuts
are multiples of 64, from any start), a planted break of the absolute sub-chunk anchor,
and agreement with the row-by-row recurrence.
Run under the CUDA simulator or on a GPU; outputs and scratch poisoned before launch.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from executor.numba_cuda import delta_chunked, delta_mma, delta_rule
from executor.numba_cuda.device import IS_SIMULATOR, poisoned, to_device
from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import assert_grid_invariant, delta_inputs, host, rng
from tests.helpers import assert_close

V0 = 3  # v starts at this column of `mixed` (the kernel must honour the offset)
TOL = 1e-4  # relative to max |ref|: fp32 sub-chunks against the float64 twin (~1e-6 seen)


def _chunked(inputs, states, slot, start_row, cuts):
    """delta_chunked over input rows [cuts[i], cuts[i + 1]) (absolute start_row + cuts[i])."""
    q, k, v, g, beta = inputs
    qn = (q * np.float32(q.shape[2] ** -0.5)).astype(np.float32)  # causal_conv1d_qkv scales q
    r = rng()
    outs = []
    for a, b in pairwise(cuts):
        mixed = np.concatenate([r.normal(size=(b - a, V0)), v[a:b].reshape(b - a, -1)], axis=1).astype(np.float32)
        with poisoned():
            out = delta_chunked.delta_chunked(
                to_device(qn[a:b]), to_device(k[a:b]), to_device(mixed), V0, to_device(g[a:b]),
                to_device(beta[a:b]), start_row + a, slot, states,
            )
        outs.append(host(out))
    return np.concatenate(outs)


@pytest.mark.parametrize(
    "start_row, rows, key_heads, value_heads, key_dim, value_dim",
    [(0, 150, 1, 2, 8, 8), (100, 60, 2, 4, 16, 12), (191, 1, 1, 1, 8, 4), (64, 70, 1, 1, 40, 20),
     (30, 20, 1, 1, 136, 8)],
    ids=["from-row-0", "off-grid-start", "one-row", "ragged-tiles", "key-dim-136"],
)
def test_delta_chunked_matches_twin(start_row, rows, key_heads, value_heads, key_dim, value_dim):
    r = rng()
    inputs = delta_inputs(r, rows, key_heads, value_heads, key_dim, value_dim)
    state0 = (r.normal(size=(3, value_heads, key_dim, value_dim)) * 0.3).astype(np.float32)
    states = to_device(state0)
    out = _chunked(inputs, states, 1, start_row, [0, rows])
    ref, ref_state = ops.gated_delta_rule_chunked(*inputs, state0[1], start_row)
    assert_close("delta out", ref, out, TOL, rel=True)
    final = states.copy_to_host()
    assert_close("delta state", ref_state, final[1], TOL, rel=True)
    np.testing.assert_array_equal(final[[0, 2]], state0[[0, 2]])


@pytest.mark.parametrize("cols, threads", [(32, 128), (16, 64), (8, 32)], ids=["cols-32", "threads-64", "cols-8"])
def test_delta_chunked_phase2_variants_match_twin(monkeypatch, cols, threads):
    """The other phase-2 block shapes (STATE_COLS, STATE_THREADS) give the twin's numbers."""
    monkeypatch.setattr(delta_chunked, "STATE_COLS", cols)
    monkeypatch.setattr(delta_chunked, "STATE_THREADS", threads)
    r = rng()
    inputs = delta_inputs(r, 40, 1, 2, 16, 36)
    state0 = (r.normal(size=(1, 2, 16, 36)) * 0.3).astype(np.float32)
    states = to_device(state0)
    out = _chunked(inputs, states, 0, 50, [0, 40])
    ref, ref_state = ops.gated_delta_rule_chunked(*inputs, state0[0], 50)
    assert_close("delta out", ref, out, TOL, rel=True)
    assert_close("delta state", ref_state, states.copy_to_host()[0], TOL, rel=True)


def test_delta_chunked_phase1_blocks_do_not_change_bits(monkeypatch):
    """Phase 1 with one block per value head (the default) against blocks owning a key
    head's whole group of 3 value heads: identical output and state bits (every block runs
    the same operations for its value head). 40 rows from row 40 cross the 64-row anchor."""
    r = rng()
    inputs = delta_inputs(r, 40, 1, 3, 8, 8)
    state0 = (r.normal(size=(1, 3, 8, 8)) * 0.3).astype(np.float32)
    states = to_device(state0)
    ours = _chunked(inputs, states, 0, 40, [0, 40])
    final = states.copy_to_host()
    monkeypatch.setattr(delta_chunked, "PHASE1_VALUE_HEADS", 0)
    states = to_device(state0)
    np.testing.assert_array_equal(_chunked(inputs, states, 0, 40, [0, 40]), ours)
    np.testing.assert_array_equal(states.copy_to_host(), final)


@pytest.mark.parametrize(
    "start_row, rows, chunkings",
    [(0, 192, [[0, 64, 128, 192], [0, 128, 192]]), (100, 156, [[0, 28, 156], [0, 92, 156]])],
    ids=["from-row-0", "from-row-100"],
)
def test_delta_chunked_is_bit_identical_on_the_64_row_grid(start_row, rows, chunkings):
    """One chunk against chunkings cut at absolute multiples of 64 (after an off-grid
    start, the first piece is the partial sub-chunk): same output and state bits."""
    r = rng()
    inputs = delta_inputs(r, rows, 1, 1, 8, 8)
    state0 = (r.normal(size=(1, 1, 8, 8)) * 0.3).astype(np.float32)
    assert_grid_invariant(lambda states, start, cuts: _chunked(inputs, states, 0, start, cuts), to_device, state0,
                          start_row, rows, chunkings)


def test_planted_chunk_start_anchor_breaks_grid_invariance(monkeypatch):
    """Sub-chunks anchored at the chunk start instead of absolute multiples of 64: a chunk
    from row 100 in one piece no longer matches the same rows cut at row 128."""
    monkeypatch.setattr(delta_chunked, "_subchunk_offset", lambda start_row: 0)
    r = rng()
    inputs = delta_inputs(r, 156, 1, 1, 8, 8)
    state0 = (r.normal(size=(1, 1, 8, 8)) * 0.3).astype(np.float32)
    whole_states, piece_states = to_device(state0), to_device(state0)
    whole = _chunked(inputs, whole_states, 0, 100, [0, 156])
    pieces = _chunked(inputs, piece_states, 0, 100, [0, 28, 156])
    assert not np.array_equal(whole, pieces)
    assert not np.array_equal(whole_states.copy_to_host(), piece_states.copy_to_host())


def test_delta_chunked_agrees_with_recurrence():
    r = rng()
    rows, start_row = 20, 54
    q, k, v, g, beta = delta_inputs(r, rows, 1, 2, 8, 8)
    state0 = (r.normal(size=(1, 2, 8, 8)) * 0.3).astype(np.float32)
    chunked_states, recurrent_states = to_device(state0), to_device(state0)
    chunked = _chunked((q, k, v, g, beta), chunked_states, 0, start_row, [0, rows])
    qn = (q * np.float32(8**-0.5)).astype(np.float32)
    with poisoned():
        recurrent = host(delta_rule.delta_recurrence(
            to_device(qn), to_device(k), to_device(v.reshape(rows, -1)), 0, to_device(g), to_device(beta),
            to_device(np.array([0, rows], np.int32)), to_device(np.array([0], np.int32)), recurrent_states,
        ))
    assert_close("chunked vs recurrent out", recurrent, chunked, TOL, rel=True)
    assert_close("chunked vs recurrent state", recurrent_states.copy_to_host(), chunked_states.copy_to_host(), TOL,
                 rel=True)


@pytest.mark.parametrize("field", ["key_dim", "heads", "slot", "strided"])
def test_delta_chunked_rejects_what_does_not_fit(field):
    key_dim = 260 if field == "key_dim" else 8
    value_heads = 3 if field == "heads" else 2
    qn = to_device(np.zeros((4, 2, 2 * key_dim), np.float32))[:, :, :key_dim]
    if field != "strided":
        qn = to_device(np.zeros((4, 2, key_dim), np.float32))
    states = to_device(np.zeros((2, value_heads, key_dim, 4), np.float32))
    mixed = to_device(np.zeros((4, value_heads * 4), np.float32))
    gates = to_device(np.zeros((4, value_heads), np.float32))
    with pytest.raises(ValueError):
        delta_chunked.delta_chunked(qn, qn, mixed, 0, gates, gates, 0, 5 if field == "slot" else 0, states)


def _mma_args(rows=4, key_heads=1, value_heads=2, key_dim=16, value_dim=8, v0=4):
    states = to_device(np.zeros((2, value_heads, key_dim, value_dim), np.float32))
    qk = to_device(np.zeros((rows, key_heads, key_dim), np.float32))
    mixed = to_device(np.zeros((rows, v0 + value_heads * value_dim), np.float32))
    gates = to_device(np.zeros((rows, value_heads), np.float32))
    return [qk, qk, mixed, v0, gates, gates, 0, 0, states]


@pytest.mark.parametrize("field, change, match", [
    ("v0", {"v0": 3}, "v0 3"), ("per_block", {"per_block": 3}, "per_block"),
    ("walk", {"walk": (16, 4)}, "walk"), ("split", {"split": 2}, "split"), ("slot", {"slot": 5}, "slot 5"),
    ("ctas", {"ctas": 3}, "ctas must be 1 or 2"), ("wgmma", {"wgmma": True}, "no wgmma walk for key_dim 16"),
])
def test_delta_mma_names_what_does_not_fit(field, change, match):
    """The tensor-core delta rule checks its arguments before compiling anything (also under
    the simulator, where it cannot run)."""
    args = _mma_args(v0=change.get("v0", 4))
    kwargs = {k: v for k, v in change.items() if k in ("per_block", "walk", "split", "ctas", "wgmma")}
    if field == "slot":
        args[7] = change["slot"]
    with pytest.raises(ValueError, match=match):
        delta_mma.delta_mma(*args, **kwargs)


def test_delta_mma_says_why_it_cannot_run():
    assert "not in" in delta_mma.unavailable(136, 8)
    if IS_SIMULATOR:
        assert "simulator" in delta_mma.unavailable(128, 128)
        with pytest.raises(RuntimeError, match="simulator"):
            delta_mma.delta_mma(*_mma_args())
    else:
        assert delta_mma.unavailable(128, 128) is None


def test_the_wgmma_walk_fits_the_qwen_shapes_and_says_why_it_cannot_run():
    """delta_wgmma's builds: key dim 128, 32 or 64 columns on 8 warps, split 3 (the 9B's and the
    27B's walk shapes); under the simulator (no NVRTC, no wgmma) its status says so."""
    from executor.numba_cuda import delta_wgmma

    assert delta_wgmma.fits(128, *delta_mma.walk_shape(128, 32), 3)
    assert delta_wgmma.fits(128, *delta_mma.walk_shape(128, 48), 3)
    assert not delta_wgmma.fits(128, 32, 8, 1) and not delta_wgmma.fits(64, 32, 8, 3)
    assert not delta_wgmma.fits(128, 32, 4, 3)
    assert "no wgmma build" in delta_mma.wgmma_walk_status(16, 8, 2)
    assert "measured as fast" in delta_mma.wgmma_walk_status(128, 128, 32)  # the 9B: 32 columns stay on mma.sync
    if IS_SIMULATOR:
        assert "simulator" in delta_wgmma.status()
        assert "simulator" in delta_mma.wgmma_walk_status(128, 128, 48)  # the 27B's 64 columns would take it


def test_delta_mma_walk_shape_fills_the_gpu_in_one_wave():
    assert delta_mma.walk_shape(128, 32) == (32, 8)  # 9B: 128 CTAs
    assert delta_mma.walk_shape(128, 48) == (64, 8)  # 27B: 96 CTAs, not 192
    assert delta_mma.walk_shape(128, 16) == (32, 8)
    assert delta_mma.walk_shape(8, 4) == (8, 4)


def test_delta_mma_prepare_ctas_two_only_past_one_wave():
    assert delta_mma.prepare_ctas(2048, 3) == 2  # 9B 8,192 rows: 128 sub-chunks x 16 key heads
    assert delta_mma.prepare_ctas(132, 3) == 1
    assert delta_mma.prepare_ctas(133, 3) == 2
    assert delta_mma.prepare_ctas(48, 3) == 1  # 27B 51 rows: one sub-chunk x 48 value heads
    assert delta_mma.prepare_ctas(48, 1) == 2  # split 1: 128 registers spill nothing
    assert delta_mma.prepare_ctas(200, 3, sms=264) == 1
