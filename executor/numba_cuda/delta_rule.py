"""The gated delta rule of the linear attention: its gates (decay and write strength; the
L2-norm of q and k runs in the conv's pass, conv.causal_conv1d_qkv) and the row-by-row
recurrence (decode: one row per lane). The chunked UT form for one stream's prefill chunk
(the fast prefill path) is delta_chunked.py.

The recurrence runs row by row in fp32 with each stream's state [value_heads, key_dim,
value_dim] held in shared memory and written back in fp32 at the end, so every row's
bits are the same whatever chunk (or decode step) it runs in: chunk-invariant at every
cut. The chunked form runs sub-chunks of 64 rows anchored at absolute multiples of 64,
each from its own rows and the incoming fp32 state: bit-identical for any chunking cut on
that grid (DESIGN: invariant grid), not at other cuts. Twins: ops.delta_gates,
ops.gated_delta_rule_chunked / ops.gated_delta_rule_step.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import THREADS, bf16_to_f32, blocks, check, empty, round_bf16
from executor.numba_cuda.launch import fast

MAX_KEY_DIM = 256
VALUE_COLS = 16
"""Value columns of the state one block owns; THREADS // VALUE_COLS key groups share them."""
KEY_GROUPS = THREADS // VALUE_COLS
_F32 = np.float32


@functools.cache
def _gates_kernel_for(bf16_in: bool):
    """The gates kernel for f32 a and b (rounded to bf16 as they are loaded) or, with `bf16_in`,
    uint16 bf16 bits (in_proj's product from cuBLASLt's bf16 epilogue): the same bits."""
    value = bf16_to_f32 if bf16_in else round_bf16

    @fast
    @cuda.jit
    def _gates_kernel(a, b, a_log, dt_bias, g, beta):
        # a, b: [rows, value_heads] f32 or bf16 (may be column slices); g, beta: [rows, value_heads] f32
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        heads = g.shape[1]
        if i >= g.shape[0] * heads:
            return
        row = u32(i // heads)  # unsigned indices (all >= 0): no negative-index wraparound code
        h = u32(i % heads)
        x = value(a[row, h]) + dt_bias[h]
        sp = x if x > _F32(20.0) else math.log1p(math.exp(x))
        g[row, h] = -math.exp(a_log[h]) * sp
        beta[row, h] = _F32(1.0) / (_F32(1.0) + math.exp(-value(b[row, h])))

    return _gates_kernel


def delta_gates(a, b, a_log, dt_bias, stream=0):
    """The decay (log space) and write strength of every row and value head:
    g = -exp(a_log) * softplus(bf16(a) + dt_bias) (softplus(x) = x past 20), beta = sigmoid(bf16(b)).

    a, b: f32 device [rows, value_heads] (may be column slices of the in_proj output), rounded
    to bf16 first (transformers' in_proj_a / in_proj_b are bf16 Linears; since session 39), or
    both uint16 bf16 bits (the same outputs as from the f32 values they round);
    a_log, dt_bias: f32 [value_heads]. Returns (g, beta), f32 [rows, value_heads]. One
    thread per element. Raises ValueError on a wrong dtype, rank or shape. Twin:
    ops.delta_gates on bf16-rounded a and b (Qwen3_5GatedDeltaNet's g and beta).
    """
    bf16_in = getattr(a, "dtype", None) == np.uint16
    check("a", a, np.uint16 if bf16_in else np.float32, 2)
    check("b", b, np.uint16 if bf16_in else np.float32, 2)
    if tuple(b.shape) != tuple(a.shape) or a_log.shape[0] != a.shape[1] or dt_bias.shape[0] != a.shape[1]:
        raise ValueError(f"a {a.shape}, b {b.shape}, a_log {a_log.shape}, dt_bias {dt_bias.shape} do not fit")
    rows, value_heads = a.shape
    g = empty((rows, value_heads), np.float32, stream)
    beta = empty((rows, value_heads), np.float32, stream)
    if rows:
        _gates_kernel_for(bf16_in)[blocks(rows * value_heads), THREADS, stream](a, b, a_log, dt_bias, g, beta)
    return g, beta


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
    # unsigned indices (all >= 0): numba emits negative-index wraparound code for signed ones
    uh, ukh, uvl, ukg, ucol, uslot = u32(head), u32(key_head), u32(vl), u32(kg), u32(col), u32(slot)
    s = cuda.shared.array((MAX_KEY_DIM, VALUE_COLS), np.float32)
    qs = cuda.shared.array(MAX_KEY_DIM, np.float32)
    ks = cuda.shared.array(MAX_KEY_DIM, np.float32)
    part = cuda.shared.array((KEY_GROUPS, VALUE_COLS), np.float32)
    if live:
        for k in range(kg, key_dim, KEY_GROUPS):
            s[u32(k), uvl] = states[uslot, uh, u32(k), ucol]
    for row in range(row_start[lane], row_start[lane + 1]):
        ur = u32(row)
        for i in range(t, key_dim, THREADS):
            qs[u32(i)] = qn[ur, ukh, u32(i)]
            ks[u32(i)] = kn[ur, ukh, u32(i)]
        cuda.syncthreads()
        decay = math.exp(g[ur, uh])
        acc = _F32(0.0)
        if live:
            for k in range(kg, key_dim, KEY_GROUPS):
                acc += (s[u32(k), uvl] * decay) * ks[u32(k)]
        part[ukg, uvl] = acc
        cuda.syncthreads()
        mem = _F32(0.0)
        for j in range(KEY_GROUPS):
            mem += part[u32(j), uvl]
        delta = _F32(0.0)
        if live:
            delta = (mixed[ur, u32(v0 + head * value_dim + col)] - mem) * beta[ur, uh]
        cuda.syncthreads()
        acc = _F32(0.0)
        if live:
            for k in range(kg, key_dim, KEY_GROUPS):
                new = s[u32(k), uvl] * decay + ks[u32(k)] * delta
                s[u32(k), uvl] = new
                acc += new * qs[u32(k)]
        part[ukg, uvl] = acc
        cuda.syncthreads()
        if kg == 0 and live:
            o = _F32(0.0)
            for j in range(KEY_GROUPS):
                o += part[u32(j), uvl]
            out[ur, uh, ucol] = o
        cuda.syncthreads()
    if live:
        for k in range(kg, key_dim, KEY_GROUPS):
            states[uslot, uh, u32(k), ucol] = s[u32(k), uvl]


def delta_recurrence(qn, kn, mixed, v0: int, g, beta, row_start, slots, states, out=None, stream=0):
    """Run the gated delta rule over each lane's rows, advancing its state in place.

    qn, kn: f32 device [rows, key_heads, key_dim] (`conv.causal_conv1d_qkv`); mixed: f32 [rows, channels]
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
