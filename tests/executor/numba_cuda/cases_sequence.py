"""Kernel cases of the row-sequential ops (causal conv1d, gated delta rule) against the
NumPy twins, including chunk invariance: rows run in any chunks, or one decode row per
lane, give the same bits. Run under the CUDA simulator or on a GPU; outputs poisoned.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from executor.numba_cuda import conv, delta_rule
from executor.numba_cuda.device import poisoned, to_device
from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import as_f32, bf16, host, rng
from tests.helpers import assert_close


def _conv(x, tails_host, weight, slot, cuts):
    """Run conv over rows of x in chunks [cuts[i], cuts[i+1]); returns (out, tails)."""
    tails = to_device(tails_host)
    outs = []
    for a, b in pairwise(cuts):
        with poisoned():
            out = conv.causal_conv1d(
                to_device(x[a:b]), to_device(np.array([0, b - a], np.int32)), to_device(np.array([slot], np.int32)),
                to_device(weight), tails,
            )
        outs.append(host(out))
    return np.concatenate(outs), tails.copy_to_host()


def test_causal_conv1d_matches_twin_and_any_chunking():
    r = rng()
    rows, channels, kernel = 7, 10, 4
    x = r.normal(size=(rows, channels)).astype(np.float32)
    weight = r.normal(size=(channels, kernel)).astype(np.float32) / 2
    tails = bf16(r.normal(size=(2, kernel - 1, channels)))
    whole, tails_whole = _conv(x, tails, weight, 1, [0, rows])
    ref, ref_tail = ops.causal_conv1d(as_f32(bf16(x)), as_f32(tails[1]), weight)
    assert_close("conv out", ref, whole, 1e-5, rel=True)
    np.testing.assert_array_equal(as_f32(tails_whole[1]), ref_tail)
    np.testing.assert_array_equal(tails_whole[0], tails[0])
    pieces, tails_pieces = _conv(x, tails, weight, 1, [0, 1, 2, 6, 7])
    np.testing.assert_array_equal(pieces, whole)
    np.testing.assert_array_equal(tails_pieces, tails_whole)


@pytest.mark.parametrize("cuts", [[0, 1, 129, 200, 300], [0, 150, 300], [0, 7, 135, 136, 300]],
                         ids=["ragged", "halves", "tile-edges"])
def test_causal_conv1d_rows_past_one_block_any_chunking(cuts):
    """More rows than THREADS and row tiles (ROW_TILE) straddling chunk cuts: same bits."""
    r = rng()
    rows, channels, kernel = 300, 5, 4
    x = r.normal(size=(rows, channels)).astype(np.float32)
    weight = r.normal(size=(channels, kernel)).astype(np.float32) / 2
    tails = bf16(r.normal(size=(1, kernel - 1, channels)))
    whole, tails_whole = _conv(x, tails, weight, 0, [0, rows])
    ref, ref_tail = ops.causal_conv1d(as_f32(bf16(x)), as_f32(tails[0]), weight)
    assert_close("conv out", ref, whole, 1e-5, rel=True)
    np.testing.assert_array_equal(as_f32(tails_whole[0]), ref_tail)
    pieces, tails_pieces = _conv(x, tails, weight, 0, cuts)
    np.testing.assert_array_equal(pieces, whole)
    np.testing.assert_array_equal(tails_pieces, tails_whole)


def test_causal_conv1d_lanes_of_several_rows():
    """Lanes of 5, 0, 135 and 1 rows in one call: row tiles cross lanes, an empty lane."""
    r = rng()
    row_start = np.array([0, 5, 5, 140, 141], np.int32)
    slots = np.array([2, 0, 3, 1], np.int32)
    channels, kernel = 3, 4
    x = r.normal(size=(row_start[-1], channels)).astype(np.float32)
    weight = r.normal(size=(channels, kernel)).astype(np.float32)
    tails = bf16(r.normal(size=(4, kernel - 1, channels)))
    d_tails = to_device(tails)
    with poisoned():
        out = host(conv.causal_conv1d(to_device(x), to_device(row_start), to_device(slots), to_device(weight),
                                      d_tails))
    new_tails = d_tails.copy_to_host()
    for lane, slot in enumerate(slots):
        a, b = row_start[lane], row_start[lane + 1]
        ref, ref_tail = ops.causal_conv1d(as_f32(bf16(x[a:b])), as_f32(tails[slot]), weight)
        assert_close(f"lane {lane}", ref, out[a:b], 1e-5, rel=True)
        np.testing.assert_array_equal(as_f32(new_tails[slot]), ref_tail)


def test_causal_conv1d_decode_lanes():
    r = rng()
    lanes, channels, kernel = 3, 6, 4
    x = r.normal(size=(lanes, channels)).astype(np.float32)
    weight = r.normal(size=(channels, kernel)).astype(np.float32)
    tails = bf16(r.normal(size=(4, kernel - 1, channels)))
    slots = np.array([2, 0, 3], np.int32)
    d_tails = to_device(tails)
    with poisoned():
        out = host(conv.causal_conv1d(to_device(x), to_device(np.arange(lanes + 1, dtype=np.int32)),
                                      to_device(slots), to_device(weight), d_tails))
    for lane, slot in enumerate(slots):
        ref, ref_tail = ops.causal_conv1d(as_f32(bf16(x[lane : lane + 1])), as_f32(tails[slot]), weight)
        assert_close(f"lane {lane}", ref, out[lane : lane + 1], 1e-5, rel=True)
        np.testing.assert_array_equal(as_f32(d_tails.copy_to_host()[slot]), ref_tail)


def _inputs(r, rows, key_heads=1, value_heads=2, key_dim=8, value_dim=4):
    key = 2 * key_heads * key_dim
    mixed = r.normal(size=(rows, key + value_heads * value_dim)).astype(np.float32)
    ab = r.normal(size=(rows, 2 * value_heads)).astype(np.float32)
    a_log = np.log(r.uniform(0.05, 1.5, value_heads)).astype(np.float32)
    dt_bias = r.normal(0, 0.5, value_heads).astype(np.float32)
    return mixed, ab, a_log, dt_bias, key_heads, key_dim


def _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, slots, row_start):
    value_heads = a_log.shape[0]
    d_ab = to_device(ab)
    with poisoned():
        qn, kn, g, beta = delta_rule.delta_prep(
            to_device(mixed), d_ab[:, :value_heads], d_ab[:, value_heads:], to_device(a_log), to_device(dt_bias),
            key_heads, key_dim,
        )
        out = delta_rule.delta_recurrence(
            qn, kn, to_device(mixed), 2 * key_heads * key_dim, g, beta, to_device(np.asarray(row_start, np.int32)),
            to_device(np.asarray(slots, np.int32)), states,
        )
    return host(qn), host(kn), host(g), host(beta), host(out)


def test_delta_prep_matches_twins():
    r = rng()
    mixed, ab, a_log, dt_bias, key_heads, key_dim = _inputs(r, 3)
    states = to_device(np.zeros((1, 2, key_dim, 4), np.float32))
    qn, kn, g, beta, _ = _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, [0], [0, 3])
    kd = key_heads * key_dim
    q = mixed[:, :kd].reshape(3, key_heads, key_dim)
    k = mixed[:, kd : 2 * kd].reshape(3, key_heads, key_dim)
    assert_close("qn", ops.l2_normalize(q) * key_dim**-0.5, qn, 1e-5, rel=True)
    assert_close("kn", ops.l2_normalize(k), kn, 1e-5, rel=True)
    g_ref, beta_ref = ops.delta_gates(ab[:, :2], ab[:, 2:], a_log, dt_bias)
    assert_close("g", g_ref, g, 1e-5, rel=True)
    assert_close("beta", beta_ref, beta, 1e-5, rel=True)


@pytest.mark.parametrize("start_row", [0, 61])
def test_delta_recurrence_matches_chunked_twin_and_any_chunking(start_row):
    r = rng()
    rows = 6
    mixed, ab, a_log, dt_bias, key_heads, key_dim = _inputs(r, rows)
    state0 = (r.normal(size=(2, 2, key_dim, 4)) * 0.3).astype(np.float32)
    states = to_device(state0)
    whole = _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, [1], [0, rows])[4]
    kd = key_heads * key_dim
    q = ops.l2_normalize(mixed[:, :kd].reshape(rows, key_heads, key_dim))
    k = ops.l2_normalize(mixed[:, kd : 2 * kd].reshape(rows, key_heads, key_dim))
    v = mixed[:, 2 * kd :].reshape(rows, 2, 4)
    g_ref, beta_ref = ops.delta_gates(ab[:, :2], ab[:, 2:], a_log, dt_bias)
    ref, ref_state = ops.gated_delta_rule_chunked(q, k, v, g_ref, beta_ref, state0[1], start_row)
    assert_close("delta out", ref, whole, 1e-4, rel=True)
    final = states.copy_to_host()
    assert_close("delta state", ref_state, final[1], 1e-4, rel=True)
    np.testing.assert_array_equal(final[0], state0[0])
    states2 = to_device(state0)
    pieces = [_delta(mixed[a:b], ab[a:b], a_log, dt_bias, key_heads, key_dim, states2, [1], [0, b - a])[4]
              for a, b in ((0, 2), (2, 3), (3, 6))]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    np.testing.assert_array_equal(states2.copy_to_host(), final)


def test_delta_recurrence_decode_lanes_match_step_twin():
    r = rng()
    lanes = 3
    mixed, ab, a_log, dt_bias, key_heads, key_dim = _inputs(r, lanes)
    state0 = (r.normal(size=(4, 2, key_dim, 4)) * 0.3).astype(np.float32)
    slots = [3, 0, 2]
    states = to_device(state0)
    _, _, _, _, out = _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, slots, range(lanes + 1))
    kd = key_heads * key_dim
    q = ops.l2_normalize(mixed[:, :kd].reshape(lanes, key_heads, key_dim))
    k = ops.l2_normalize(mixed[:, kd : 2 * kd].reshape(lanes, key_heads, key_dim))
    v = mixed[:, 2 * kd :].reshape(lanes, 2, 4)
    g_ref, beta_ref = ops.delta_gates(ab[:, :2], ab[:, 2:], a_log, dt_bias)
    ref, ref_state = ops.gated_delta_rule_step(q, k, v, g_ref, beta_ref, state0[slots])
    assert_close("decode out", ref, out, 1e-4, rel=True)
    assert_close("decode states", ref_state, states.copy_to_host()[slots], 1e-4, rel=True)
