"""The tensor-core chunked gated delta rule (delta_mma.py, delta_mma.cu) on a real GPU: values
against the float64 twin and the CUDA-core path at both tf32 splits, every output row and
the state bit-identical for any chunking cut on the 64-row grid, a planted break of the
absolute sub-chunk anchor, and the CTA shapes (value heads per phase-1 CTA, state columns and
warps of phase 2) changing no bit. Outputs are poisoned before each launch (`host` fails on
any element left unwritten). Marked `cuda`: the CUDA simulator cannot run a linked CUDA C++
device function, so these skip without a GPU (the backend then runs delta_chunked.py, whose
cases run under the simulator).
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from executor.numba_cuda import delta_chunked, delta_mma  # noqa: E402
from executor.numba_cuda.device import poisoned, to_device  # noqa: E402
from executor.reference import ops  # noqa: E402
from tests.executor.numba_cuda.kernel_support import assert_grid_invariant, delta_inputs, host, rng  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

V0 = 4  # v starts at this column of `mixed` (16-byte rows: a multiple of 4)
TOL = {1: 4e-3, 3: 1e-4}
"""Relative to max |ref|, against the float64 twin: plain tf32 operands (10-bit mantissa) and
3xTF32 (~fp32 operands)."""


def _mma(inputs, states, slot, start_row, cuts, anchor_at_start=False, **kwargs):
    """delta_mma over input rows [cuts[i], cuts[i + 1]) (absolute start_row + cuts[i]).
    anchor_at_start (a planted break): the kernels read each piece's start as row 0, so its
    sub-chunks are anchored at the piece's start instead of absolute multiples of 64."""
    q, k, v, g, beta = inputs
    qn = (q * np.float32(q.shape[2] ** -0.5)).astype(np.float32)
    r = rng()
    outs = []
    for a, b in pairwise(cuts):
        mixed = np.concatenate([r.normal(size=(b - a, V0)), v[a:b].reshape(b - a, -1)], axis=1).astype(np.float32)
        if anchor_at_start:
            kwargs["meta"] = to_device(np.asarray([b - a, 0, slot], np.int32))
        with poisoned():
            out = delta_mma.delta_mma(
                to_device(qn[a:b]), to_device(k[a:b]), to_device(mixed), V0, to_device(g[a:b]), to_device(beta[a:b]),
                start_row + a, slot, states, **kwargs,
            )
        outs.append(host(out))
    return np.concatenate(outs)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize(
    "start_row, rows, key_heads, value_heads, key_dim, value_dim",
    [(0, 200, 2, 4, 128, 128), (100, 150, 1, 3, 128, 128), (30, 70, 1, 3, 16, 8), (0, 1, 2, 4, 16, 16),
     (191, 1, 1, 2, 32, 32), (64, 64, 2, 2, 64, 64), (5, 300, 1, 2, 128, 32)],
    ids=["9b-heads", "group-3-off-grid", "tiny-dims", "one-row", "one-row-at-191", "one-sub-chunk", "wide-key"],
)
def test_delta_mma_matches_twin(split, start_row, rows, key_heads, value_heads, key_dim, value_dim):
    r = rng()
    inputs = delta_inputs(r, rows, key_heads, value_heads, key_dim, value_dim)
    state0 = (r.normal(size=(3, value_heads, key_dim, value_dim)) * 0.3).astype(np.float32)
    states = to_device(state0)
    out = _mma(inputs, states, 1, start_row, [0, rows], split=split)
    ref, ref_state = ops.gated_delta_rule_chunked(*inputs, state0[1], start_row)
    assert_close("delta out", ref, out, TOL[split], rel=True)
    final = states.copy_to_host()
    assert_close("delta state", ref_state, final[1], TOL[split], rel=True)
    np.testing.assert_array_equal(final[[0, 2]], state0[[0, 2]])


def test_delta_mma_agrees_with_the_cuda_core_path():
    r = rng()
    inputs = delta_inputs(r, 130, 2, 4, 128, 128)
    state0 = (r.normal(size=(1, 4, 128, 128)) * 0.3).astype(np.float32)
    ours_states, cores_states = to_device(state0), to_device(state0)
    ours = _mma(inputs, ours_states, 0, 40, [0, 130])
    q, k, v, g, beta = inputs
    qn = (q * np.float32(128**-0.5)).astype(np.float32)
    with poisoned():
        cores = host(delta_chunked.delta_chunked(to_device(qn), to_device(k), to_device(v.reshape(130, -1)), 0,
                                                 to_device(g), to_device(beta), 40, 0, cores_states))
    assert_close("mma vs cuda cores out", cores, ours, TOL[delta_mma.SPLIT], rel=True)
    assert_close("mma vs cuda cores state", cores_states.copy_to_host(), ours_states.copy_to_host(),
                 TOL[delta_mma.SPLIT], rel=True)


@pytest.mark.parametrize(
    "start_row, rows, chunkings",
    [(0, 320, [[0, 64, 128, 320], [0, 128, 192, 256, 320], [0, 256, 320]]),
     (100, 156, [[0, 28, 156], [0, 92, 156], [0, 28, 92, 156]])],
    ids=["from-row-0", "from-row-100"],
)
def test_delta_mma_is_bit_identical_on_the_64_row_grid(start_row, rows, chunkings):
    """One chunk against chunkings cut at absolute multiples of 64 (after an off-grid start,
    the first piece is the partial sub-chunk): same output and state bits."""
    r = rng()
    inputs = delta_inputs(r, rows, 2, 6, 128, 128)
    state0 = (r.normal(size=(1, 6, 128, 128)) * 0.3).astype(np.float32)
    assert_grid_invariant(lambda states, start, cuts: _mma(inputs, states, 0, start, cuts), to_device, state0,
                          start_row, rows, chunkings)


def test_planted_chunk_start_anchor_breaks_grid_invariance(monkeypatch):
    """Sub-chunks anchored at the chunk start instead of absolute multiples of 64: a chunk
    from row 100 in one piece no longer matches the same rows cut at row 128."""
    monkeypatch.setattr(delta_mma, "_subchunk_offset", lambda start_row: 0)  # the launch grid's anchor
    r = rng()
    inputs = delta_inputs(r, 156, 1, 2, 128, 128)
    state0 = (r.normal(size=(1, 2, 128, 128)) * 0.3).astype(np.float32)
    whole_states, piece_states = to_device(state0), to_device(state0)
    whole = _mma(inputs, whole_states, 0, 100, [0, 156], anchor_at_start=True)
    pieces = _mma(inputs, piece_states, 0, 100, [0, 28, 156], anchor_at_start=True)
    assert not np.array_equal(whole, pieces)
    assert not np.array_equal(whole_states.copy_to_host(), piece_states.copy_to_host())


@pytest.mark.parametrize("per_block, walk, ctas", [(1, (32, 4), None), (3, (64, 8), None), (1, (64, 8), 2),
                                                   (3, (32, 8), 2)])
def test_cta_shapes_change_no_bit(per_block, walk, ctas):
    """Value heads per phase-1 CTA (1 or the key head's group of 3), phase 1's registers capped
    for 2 CTAs a multiprocessor (the default here, at most 18 CTAs, is 1) and the phase-2 split (32
    state columns on 4 or 8 warps, 64 on 8) give the same output and state bits as the defaults."""
    r = rng()
    inputs = delta_inputs(r, 150, 2, 6, 128, 128)
    state0 = (r.normal(size=(1, 6, 128, 128)) * 0.3).astype(np.float32)
    states = to_device(state0)
    want = _mma(inputs, states, 0, 37, [0, 150])
    want_state = states.copy_to_host()
    states = to_device(state0)
    got = _mma(inputs, states, 0, 37, [0, 150], per_block=per_block, walk=walk, ctas=ctas)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(states.copy_to_host(), want_state)


def test_long_chunk_matches_twin_and_its_grid_pieces():
    """4,100 rows at the 9B linear-attention head shapes (16 key / 32 value heads of 128), from
    row 0: the twin within tolerance, and cut at 2048 and 4096 the same bits, as with phase 1
    at one CTA a multiprocessor (the default at this grid, 1,040 CTAs, is 2)."""
    r = rng()
    rows = 4100
    inputs = delta_inputs(r, rows, 16, 32, 128, 128)
    state0 = np.zeros((1, 32, 128, 128), np.float32)
    states = to_device(state0)
    whole = _mma(inputs, states, 0, 0, [0, rows])
    final = states.copy_to_host()
    ref, ref_state = ops.gated_delta_rule_chunked(*inputs, state0[0], 0)
    assert_close("long out", ref, whole, TOL[delta_mma.SPLIT], rel=True)
    assert_close("long state", ref_state, final[0], TOL[delta_mma.SPLIT], rel=True)
    states = to_device(state0)
    np.testing.assert_array_equal(_mma(inputs, states, 0, 0, [0, 2048, 4096, rows]), whole)
    np.testing.assert_array_equal(states.copy_to_host(), final)
    states = to_device(state0)
    np.testing.assert_array_equal(_mma(inputs, states, 0, 0, [0, rows], ctas=1), whole)
    np.testing.assert_array_equal(states.copy_to_host(), final)


def test_probe_passes_at_the_model_dims():
    for key_dim, value_dim in ((128, 128), (16, 8), (16, 16)):
        delta_mma.probe(key_dim, value_dim)


def test_the_wgmma_walk_runs_on_a_hopper_gpu():
    """On an H100/H200 (sm_90) the wgmma walk builds and its check passes (its bits are the
    mma.sync walk's), so delta_mma takes it by default at the 27B's shape (48 value heads: 64
    columns a CTA), not at the 9B's (32: 32 columns, where it measured no faster)."""
    from executor.numba_cuda import attention_wgmma, delta_wgmma

    if attention_wgmma.unavailable() is not None:
        pytest.skip(attention_wgmma.unavailable())
    assert delta_wgmma.status() is None
    sms = delta_mma.multiprocessors()
    for heads in (32, 48):  # the 9B's 32 columns a CTA stay on mma.sync where walk_shape gives it 32 (132 SMs)
        bv = delta_mma.walk_shape(128, heads, sms)[0]
        why = delta_mma.wgmma_walk_status(128, 128, heads)
        assert why is None if bv in delta_wgmma.FASTER else "measured as fast" in why, (heads, bv, why)
    if sms >= 128:
        assert delta_mma.walk_shape(128, 32, sms)[0] == 32 and delta_mma.walk_shape(128, 48, sms)[0] == 64


@pytest.mark.parametrize("walk", [(32, 8), (64, 8)])
@pytest.mark.parametrize("start_row, rows, key_heads, value_heads, cuts",
                         [(37, 300, 2, 6, [0, 300]), (0, 4100, 16, 32, [0, 2048, 4100]), (1000, 40, 1, 2, [0, 40])],
                         ids=["off-grid", "9b-heads-long", "one-partial-sub-chunk"])
def test_the_wgmma_walk_gives_the_mma_sync_walk_s_bits(walk, start_row, rows, key_heads, value_heads, cuts):
    """Phase 2 on wgmma against mma.sync (wgmma=True / False), the same phase 1: every output
    and state bit equal, at both column splits, over partial first and last sub-chunks and a
    carried state; and, padded (the captured launch: rows and start read from meta), the same."""
    from executor.numba_cuda import attention_wgmma

    if attention_wgmma.unavailable() is not None:
        pytest.skip(attention_wgmma.unavailable())
    r = rng()
    inputs = delta_inputs(r, rows, key_heads, value_heads, 128, 128)
    state0 = (r.normal(size=(2, value_heads, 128, 128)) * 0.3).astype(np.float32)
    results = []
    for kwargs in ({"wgmma": False}, {"wgmma": True}, {"wgmma": True, "padded": True}):
        states = to_device(state0)
        results.append((_mma(inputs, states, 1, start_row, cuts, walk=walk, **kwargs), states.copy_to_host()))
    for got, got_state in results[1:]:
        np.testing.assert_array_equal(got.view(np.uint32), results[0][0].view(np.uint32))
        np.testing.assert_array_equal(got_state.view(np.uint32), results[0][1].view(np.uint32))
    np.testing.assert_array_equal(results[0][1][0], state0[0])
