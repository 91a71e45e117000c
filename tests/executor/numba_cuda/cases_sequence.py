"""Kernel cases of the row-sequential ops (causal conv1d, gated delta rule) against the
NumPy twins, including chunk invariance: rows run in any chunks, or one decode row per
lane, give the same bits. Run under the CUDA simulator or on a GPU; outputs poisoned.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from executor.numba_cuda import conv, delta_rule
from executor.numba_cuda.device import IS_SIMULATOR, THREADS, poisoned, to_device
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
    """Lanes of 5, 0, 135, 2 and 40 rows in one call: row tiles cross lanes, an empty lane, a lane
    starting at 6 mod 8 (a review's plant: a tile counted inside its lane one row early read x's
    row before the lane instead of its tail, and no other lane here caught it)."""
    r = rng()
    row_start = np.array([0, 5, 5, 140, 142, 182], np.int32)
    slots = np.array([2, 0, 3, 1, 4], np.int32)
    channels, kernel = 3, 4
    x = r.normal(size=(row_start[-1], channels)).astype(np.float32)
    weight = r.normal(size=(channels, kernel)).astype(np.float32)
    tails = bf16(r.normal(size=(5, kernel - 1, channels)))
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


def _tree_norm(y, key_dim, scale):
    """y (f32 [rows, key_dim]) L2-normalised as the conv's norm sums it: thread t of THREADS
    adds channels t, t + THREADS, ... to 0, then a tree over the THREADS slots (step THREADS
    / 2 down to 1); all in float32, so the bits are the kernel's (no product is added to
    anything but 0 when key_dim <= THREADS, so no FMA can differ)."""
    rows = y.shape[0]
    buf = np.zeros((rows, THREADS), np.float32)
    for i in range(key_dim):
        buf[:, i % THREADS] = buf[:, i % THREADS] + y[:, i] * y[:, i]
    step = THREADS // 2
    while step:
        buf[:, :step] = buf[:, :step] + buf[:, step : 2 * step]
        step //= 2
    inv = np.float32(1.0) / np.sqrt(buf[:, :1] + np.float32(1e-6))
    return (y * inv) * np.float32(scale)


def _conv_qkv(x, tails, weight, key_heads, key_dim, row_start, slots):
    d_tails = to_device(tails)
    with poisoned():
        qn, kn, v = conv.causal_conv1d_qkv(to_device(x), to_device(np.asarray(row_start, np.int32)),
                                           to_device(np.asarray(slots, np.int32)), to_device(weight), d_tails,
                                           key_heads, key_dim)
    return host(qn), host(kn), host(v), d_tails.copy_to_host()


def test_causal_conv1d_qkv_takes_bf16_x_with_the_f32_bits():
    """x as bf16 bits (in_proj from cuBLASLt's bf16 epilogue) gives the outputs and tails of
    the f32 x it rounds, over lanes (row tiles crossing lanes, an empty lane), with columns
    sliced from a wider product as the backend does (kept small: the simulator runs a thread
    at a time; on the H100 in session 39 it passed with a decode-row case too)."""
    r = rng()
    key_heads, key_dim, taps = 2, 8, 4
    channels = 2 * key_heads * key_dim + 12
    weight = (r.normal(size=(channels, taps)) / 2).astype(np.float32)
    tails = bf16(r.normal(size=(4, taps - 1, channels)))
    for row_start, slots in (([0, 5, 5, 11, 12], [2, 0, 3, 1]),):
        wide = r.normal(size=(row_start[-1], channels + 6)).astype(np.float32)
        outs = []
        for x in (to_device(wide), to_device(bf16(wide))):
            d_tails = to_device(tails)
            with poisoned():
                got = conv.causal_conv1d_qkv(x[:, :channels], to_device(np.asarray(row_start, np.int32)),
                                             to_device(np.asarray(slots, np.int32)), to_device(weight), d_tails,
                                             key_heads, key_dim)
            outs.append([host(o) for o in got] + [d_tails.copy_to_host()])
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("key_heads", "key_dim", "value_channels", "rows"),
                         [(1, 8, 12, 13), (1, 128, 4, 9), (1, 160, 0, 9)], ids=["small", "a-block", "two-a-thread"])
def test_causal_conv1d_qkv_is_the_conv_then_the_norm(key_heads, key_dim, value_channels, rows):
    """q and k heads normalised in the conv's pass: the plain conv's values, normalised in the
    fixed order (bit for bit where key_dim <= THREADS), and the twins'; v the plain conv's
    bits; tails advanced as the plain conv advances them; any chunking the same bits. Rows
    past one tile of ROW_TILE (the simulator runs a block's barriers slowly: few rows)."""
    r = rng()
    taps = 4
    channels = 2 * key_heads * key_dim + value_channels
    x = r.normal(size=(rows, channels)).astype(np.float32)
    weight = (r.normal(size=(channels, taps)) / 2).astype(np.float32)
    tails = bf16(r.normal(size=(2, taps - 1, channels)))
    qn, kn, v, new_tails = _conv_qkv(x, tails, weight, key_heads, key_dim, [0, rows], [1])
    plain, plain_tails = _conv(x, tails, weight, 1, [0, rows])
    np.testing.assert_array_equal(new_tails, plain_tails)
    np.testing.assert_array_equal(v, plain[:, 2 * key_heads * key_dim :])
    kd = key_heads * key_dim
    y_q = plain[:, :kd].reshape(rows, key_heads, key_dim)
    y_k = plain[:, kd : 2 * kd].reshape(rows, key_heads, key_dim)
    assert_close("qn", ops.l2_normalize(y_q) * np.float32(key_dim**-0.5), qn, 1e-6, rel=True)
    assert_close("kn", ops.l2_normalize(y_k), kn, 1e-6, rel=True)
    if key_dim <= THREADS or IS_SIMULATOR:  # past THREADS a GPU may fuse a thread's second square
        scale = np.float32(1.0) / np.sqrt(np.float32(key_dim))
        for h in range(key_heads):
            np.testing.assert_array_equal(qn[:, h], _tree_norm(y_q[:, h], key_dim, scale))
            np.testing.assert_array_equal(kn[:, h], _tree_norm(y_k[:, h], key_dim, np.float32(1.0)))
    ref, _ = ops.causal_conv1d(as_f32(bf16(x)), as_f32(tails[1]), weight)
    assert_close("qn vs twins", ops.l2_normalize(ref[:, :kd].reshape(rows, key_heads, key_dim))
                 * np.float32(key_dim**-0.5), qn, 1e-5, rel=True)
    if key_dim > 8:
        return
    d_tails = to_device(tails)  # rows 0-4 then 5-12 in two calls: the same bits
    pieces = []
    for a, b in ((0, 5), (5, rows)):
        with poisoned():
            pieces.append([host(o) for o in conv.causal_conv1d_qkv(
                to_device(x[a:b]), to_device(np.array([0, b - a], np.int32)), to_device(np.array([1], np.int32)),
                to_device(weight), d_tails, key_heads, key_dim)])
    for i, whole in enumerate((qn, kn, v)):
        np.testing.assert_array_equal(np.concatenate([p[i] for p in pieces]), whole)
    np.testing.assert_array_equal(d_tails.copy_to_host(), new_tails)


def test_causal_conv1d_qkv_lanes_and_decode():
    """Lanes of 5, 0, 6 and 1 rows (tiles cross lanes), and one row per lane (decode), two q
    and two k heads: every value is the plain conv's of the same call, normalised in the
    fixed order, bit for bit (the plain conv's lanes are checked against the twin by
    test_causal_conv1d_lanes_of_several_rows and test_causal_conv1d_decode_lanes)."""
    r = rng()
    key_heads, key_dim, taps = 2, 8, 4
    kd = key_heads * key_dim
    channels = 2 * kd + 4
    weight = (r.normal(size=(channels, taps)) / 2).astype(np.float32)
    tails = bf16(r.normal(size=(4, taps - 1, channels)))
    scale = np.float32(1.0) / np.sqrt(np.float32(key_dim))
    for row_start, slots in (([0, 5, 5, 11, 12], [2, 0, 3, 1]), ([0, 1, 2, 3], [2, 0, 3])):
        x = r.normal(size=(row_start[-1], channels)).astype(np.float32)
        qn, kn, v, new_tails = _conv_qkv(x, tails, weight, key_heads, key_dim, row_start, slots)
        d_tails = to_device(tails)
        with poisoned():
            plain = host(conv.causal_conv1d(to_device(x), to_device(np.asarray(row_start, np.int32)),
                                            to_device(np.asarray(slots, np.int32)), to_device(weight), d_tails))
        np.testing.assert_array_equal(new_tails, d_tails.copy_to_host())
        np.testing.assert_array_equal(v, plain[:, 2 * kd :])
        for h in range(key_heads):
            q_cols, k_cols = plain[:, h * key_dim : (h + 1) * key_dim], plain[:, kd + h * key_dim : kd + (h + 1) * key_dim]
            np.testing.assert_array_equal(qn[:, h], _tree_norm(q_cols, key_dim, scale))
            np.testing.assert_array_equal(kn[:, h], _tree_norm(k_cols, key_dim, np.float32(1)))


def test_causal_conv1d_qkv_refuses_what_does_not_fit():
    r = rng()
    x = to_device(r.normal(size=(3, 40)).astype(np.float32))
    weight = to_device(np.ones((40, 4), np.float32))
    tails = to_device(np.zeros((1, 3, 40), np.uint16))
    rs, sl = to_device(np.array([0, 3], np.int32)), to_device(np.array([0], np.int32))
    with pytest.raises(ValueError, match="key_dim must be in 1..256"):
        conv.causal_conv1d_qkv(x, rs, sl, weight, tails, 1, 0)
    with pytest.raises(ValueError, match="q and k heads of 16 do not fit"):
        conv.causal_conv1d_qkv(x, rs, sl, weight, tails, 2, 16)
    with pytest.raises(ValueError, match="do not fit x"):
        conv.causal_conv1d_qkv(x, rs, sl, to_device(np.ones((39, 4), np.float32)), tails, 1, 16)


def _inputs(r, rows, key_heads=1, value_heads=2, key_dim=8, value_dim=4):
    """(q | k | v conv outputs [rows, channels], a | b [rows, 2 value_heads] (bf16 values, as
    transformers' bf16 in_proj_a / in_proj_b give them and delta_gates rounds them), a_log,
    dt_bias, key_heads, key_dim)."""
    key = 2 * key_heads * key_dim
    mixed = r.normal(size=(rows, key + value_heads * value_dim)).astype(np.float32)
    ab = as_f32(bf16(r.normal(size=(rows, 2 * value_heads)).astype(np.float32)))
    a_log = np.log(r.uniform(0.05, 1.5, value_heads)).astype(np.float32)
    dt_bias = r.normal(0, 0.5, value_heads).astype(np.float32)
    return mixed, ab, a_log, dt_bias, key_heads, key_dim


def _qk(mixed, key_heads, key_dim):
    """The normalised q (times key_dim^-0.5) and k of conv outputs, as the conv's pass gives them."""
    rows, kd = mixed.shape[0], key_heads * key_dim
    q = ops.l2_normalize(mixed[:, :kd].reshape(rows, key_heads, key_dim)) * np.float32(key_dim**-0.5)
    k = ops.l2_normalize(mixed[:, kd : 2 * kd].reshape(rows, key_heads, key_dim))
    return q.astype(np.float32), k


def _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, slots, row_start):
    value_heads = a_log.shape[0]
    d_ab = to_device(ab)
    q, k = _qk(mixed, key_heads, key_dim)
    with poisoned():
        g, beta = delta_rule.delta_gates(d_ab[:, :value_heads], d_ab[:, value_heads:], to_device(a_log),
                                         to_device(dt_bias))
        out = delta_rule.delta_recurrence(
            to_device(q), to_device(k), to_device(np.ascontiguousarray(mixed[:, 2 * key_heads * key_dim :])), 0, g,
            beta, to_device(np.asarray(row_start, np.int32)), to_device(np.asarray(slots, np.int32)), states,
        )
    return q, k, host(g), host(beta), host(out)


def test_delta_gates_match_twins():
    r = rng()
    mixed, ab, a_log, dt_bias, key_heads, key_dim = _inputs(r, 3)
    ab[0, 0] = 25.0  # softplus's linear branch (x > 20)
    states = to_device(np.zeros((1, 2, key_dim, 4), np.float32))
    ab[1, 1] = np.uint32(0x3F808001).view(np.float32)  # a: one ulp over a bf16 tie, rounds up (to 0x3F81)
    ab[1, 3] = np.uint32(0x3F808001).view(np.float32)  # b likewise
    _, _, g, beta, _ = _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, [0], [0, 3])
    rounded = as_f32(bf16(ab))  # transformers' in_proj_a / in_proj_b are bf16 Linears
    g_ref, beta_ref = ops.delta_gates(rounded[:, :2], rounded[:, 2:], a_log, dt_bias)
    assert_close("g", g_ref, g, 1e-5, rel=True)
    assert_close("beta", beta_ref, beta, 1e-5, rel=True)
    d_ab = to_device(bf16(ab))  # bf16 a and b (in_proj from cuBLASLt's bf16 epilogue): the same bits
    with poisoned():
        g16, beta16 = delta_rule.delta_gates(d_ab[:, :2], d_ab[:, 2:], to_device(a_log), to_device(dt_bias))
    np.testing.assert_array_equal(host(g16), g)
    np.testing.assert_array_equal(host(beta16), beta)
    ab[1, 1] = ab[1, 3] = np.uint32(0x3F800000).view(np.float32)  # what the rounding down would give: other bits
    _, _, g_down, beta_down, _ = _delta(mixed, ab, a_log, dt_bias, key_heads, key_dim, states, [0], [0, 3])
    assert g_down[1, 1] != g[1, 1] and beta_down[1, 1] != beta[1, 1]
    d = to_device(ab)
    with pytest.raises(ValueError, match="do not fit"):
        delta_rule.delta_gates(d[:, :2], d[:, 1:], to_device(a_log), to_device(dt_bias))


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
