"""The gated delta rule of the linear attention: input prep (L2-norm of q and k, decay and
write strength) and the row-by-row recurrence (decode: one row per lane). The chunked UT
form for one stream's prefill chunk (the fast prefill path) is delta_chunked.py.

The recurrence runs row by row in fp32 with each stream's state [value_heads, key_dim,
value_dim] held in shared memory and written back in fp32 at the end, so every row's
bits are the same whatever chunk (or decode step) it runs in: chunk-invariant at every
cut. The chunked form runs sub-chunks of 64 rows anchored at absolute multiples of 64,
each from its own rows and the incoming fp32 state: bit-identical for any chunking cut on
that grid (DESIGN: invariant grid), not at other cuts. Twins: ops.l2_normalize,
ops.delta_gates, ops.gated_delta_rule_chunked / ops.gated_delta_rule_step.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import THREADS, check, empty
from executor.numba_cuda.launch import fast

MAX_KEY_DIM = 256
VALUE_COLS = 16
"""Value columns of the state one block owns; THREADS // VALUE_COLS key groups share them."""
KEY_GROUPS = THREADS // VALUE_COLS
_F32 = np.float32


@fast
@cuda.jit
def _prep_kernel(mixed, a, b, a_log, dt_bias, key_heads, key_dim, qn, kn, g, beta):
    # mixed: [rows, 2 * key_heads * key_dim + value_dim] f32 (conv output: q | k | v)
    # a, b: [rows, value_heads] f32; qn, kn: [rows, key_heads, key_dim] f32; g, beta: [rows, value_heads]
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    t = cuda.threadIdx.x
    if head == key_heads:
        for h in range(t, g.shape[1], THREADS):
            x = a[row, h] + dt_bias[h]
            sp = x if x > _F32(20.0) else math.log1p(math.exp(x))
            g[row, h] = -math.exp(a_log[h]) * sp
            beta[row, h] = _F32(1.0) / (_F32(1.0) + math.exp(-b[row, h]))
        return
    buf = cuda.shared.array((2, THREADS), np.float32)
    q0 = head * key_dim
    k0 = key_heads * key_dim + head * key_dim
    sq = _F32(0.0)
    sk = _F32(0.0)
    for i in range(t, key_dim, THREADS):
        sq += mixed[row, q0 + i] * mixed[row, q0 + i]
        sk += mixed[row, k0 + i] * mixed[row, k0 + i]
    buf[0, t] = sq
    buf[1, t] = sk
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            buf[0, t] += buf[0, t + step]
            buf[1, t] += buf[1, t + step]
        cuda.syncthreads()
        step //= 2
    inv_q = _F32(1.0) / math.sqrt(buf[0, 0] + _F32(1e-6))
    inv_k = _F32(1.0) / math.sqrt(buf[1, 0] + _F32(1e-6))
    scale = _F32(1.0) / math.sqrt(_F32(key_dim))
    for i in range(t, key_dim, THREADS):
        qn[row, head, i] = (mixed[row, q0 + i] * inv_q) * scale
        kn[row, head, i] = mixed[row, k0 + i] * inv_k


def delta_prep(mixed, a, b, a_log, dt_bias, key_heads: int, key_dim: int, stream=0):
    """L2-normalised (and for q, 1/sqrt(key_dim)-scaled) q and k, and the gates.

    mixed: f32 device [rows, conv_channels] (conv output); a, b: f32 [rows, value_heads]
    (may be column slices); a_log, dt_bias: f32 [value_heads].
    Returns (qn, kn f32 [rows, key_heads, key_dim], g, beta f32 [rows, value_heads]).
    Twins: ops.l2_normalize (q then times key_dim**-0.5), ops.delta_gates.
    """
    check("mixed", mixed, np.float32, 2)
    check("a", a, np.float32, 2)
    check("b", b, np.float32, 2)
    rows = mixed.shape[0]
    value_heads = a.shape[1]
    qn = empty((rows, key_heads, key_dim), np.float32, stream)
    kn = empty((rows, key_heads, key_dim), np.float32, stream)
    g = empty((rows, value_heads), np.float32, stream)
    beta = empty((rows, value_heads), np.float32, stream)
    if rows:
        _prep_kernel[(rows, key_heads + 1), THREADS, stream](
            mixed, a, b, a_log, dt_bias, key_heads, key_dim, qn, kn, g, beta
        )
    return qn, kn, g, beta


@fast
@cuda.jit
def _recurrence_kernel(qn, kn, mixed, v0, g, beta, row_start, slots, states, out):
    # qn, kn: [rows, key_heads, key_dim] f32; mixed: [rows, channels] f32 (v at column v0)
    # g, beta: [rows, value_heads]; states: [slots, value_heads, key_dim, value_dim] f32
    # out: [rows, value_heads, value_dim] f32
    head = cuda.blockIdx.x
    col0 = cuda.blockIdx.y * VALUE_COLS
    lane = cuda.blockIdx.z
    t = cuda.threadIdx.x
    vl = t % VALUE_COLS
    kg = t // VALUE_COLS
    value_heads = states.shape[1]
    key_dim = states.shape[2]
    value_dim = states.shape[3]
    key_head = head // (value_heads // qn.shape[1])
    col = col0 + vl
    live = col < value_dim
    slot = slots[lane]
    s = cuda.shared.array((MAX_KEY_DIM, VALUE_COLS), np.float32)
    qs = cuda.shared.array(MAX_KEY_DIM, np.float32)
    ks = cuda.shared.array(MAX_KEY_DIM, np.float32)
    part = cuda.shared.array((KEY_GROUPS, VALUE_COLS), np.float32)
    if live:
        for k in range(kg, key_dim, KEY_GROUPS):
            s[k, vl] = states[slot, head, k, col]
    for row in range(row_start[lane], row_start[lane + 1]):
        for i in range(t, key_dim, THREADS):
            qs[i] = qn[row, key_head, i]
            ks[i] = kn[row, key_head, i]
        cuda.syncthreads()
        decay = math.exp(g[row, head])
        acc = _F32(0.0)
        if live:
            for k in range(kg, key_dim, KEY_GROUPS):
                acc += (s[k, vl] * decay) * ks[k]
        part[kg, vl] = acc
        cuda.syncthreads()
        mem = _F32(0.0)
        for j in range(KEY_GROUPS):
            mem += part[j, vl]
        delta = _F32(0.0)
        if live:
            delta = (mixed[row, v0 + head * value_dim + col] - mem) * beta[row, head]
        cuda.syncthreads()
        acc = _F32(0.0)
        if live:
            for k in range(kg, key_dim, KEY_GROUPS):
                new = s[k, vl] * decay + ks[k] * delta
                s[k, vl] = new
                acc += new * qs[k]
        part[kg, vl] = acc
        cuda.syncthreads()
        if kg == 0 and live:
            o = _F32(0.0)
            for j in range(KEY_GROUPS):
                o += part[j, vl]
            out[row, head, col] = o
        cuda.syncthreads()
    if live:
        for k in range(kg, key_dim, KEY_GROUPS):
            states[slot, head, k, col] = s[k, vl]


def delta_recurrence(qn, kn, mixed, v0: int, g, beta, row_start, slots, states, out=None, stream=0):
    """Run the gated delta rule over each lane's rows, advancing its state in place.

    qn, kn: f32 device [rows, key_heads, key_dim] (`delta_prep`); mixed: f32 [rows, channels]
    holding v at columns [v0, v0 + value_heads * value_dim); g, beta: f32 [rows, value_heads];
    row_start: i32 [lanes + 1] (lane l owns rows [row_start[l], row_start[l + 1]));
    slots: i32 [lanes], distinct; states: f32 [slots, value_heads, key_dim, value_dim] (one
    layer). Returns f32 [rows, value_heads, value_dim].
    Twins: ops.gated_delta_rule_chunked (prefill), ops.gated_delta_rule_step (decode).
    """
    check("qn", qn, np.float32, 3)
    check("kn", kn, np.float32, 3)
    check("states", states, np.float32, 4)
    rows = qn.shape[0]
    _, value_heads, key_dim, value_dim = states.shape
    lanes = slots.shape[0]
    if key_dim > MAX_KEY_DIM or qn.shape[2] != key_dim or value_heads % qn.shape[1]:
        raise ValueError(f"qn {qn.shape} does not fit states {states.shape}")
    if mixed.shape[1] < v0 + value_heads * value_dim or tuple(g.shape) != (rows, value_heads):
        raise ValueError(f"mixed {mixed.shape} / g {g.shape} do not fit states {states.shape}")
    if row_start.shape[0] != lanes + 1:
        raise ValueError(f"row_start has {row_start.shape[0]} entries for {lanes} lanes")
    out = empty((rows, value_heads, value_dim), np.float32, stream) if out is None else out
    if rows and lanes:
        grid = (value_heads, (value_dim + VALUE_COLS - 1) // VALUE_COLS, lanes)
        _recurrence_kernel[grid, THREADS, stream](qn, kn, mixed, v0, g, beta, row_start, slots, states, out)
    return out
