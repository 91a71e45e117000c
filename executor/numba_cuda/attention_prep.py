"""QK-norm and partial RoPE of the gated attention, and the K/V write into the cache.

`q_norm_rope` reads the query half of each head of the q_proj output (the gate half is
read later by attention's combine); `kv_norm_rope_store` norms and rotates K, and writes
K and V as bf16 at their absolute rows in a stream's cache. Twins: ops.split_query_gate,
ops.rms_norm (QK-norm), ops.rope. Angles in float64. K: one block per (row, head); q: one
block per row and Q_HEADS_PER_BLOCK heads, every bit the same as one block per (row, head).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import THREADS, check, empty, f32_to_bf16
from executor.numba_cuda.launch import fast
from executor.numba_cuda.norms import block_sum, fold_wide, warp_sum

MAX_HEAD_DIM = 512
_F32 = np.float32


def inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """float64 [rotary_dim / 2]: theta^(-2i / rotary_dim), as in ops.rope."""
    return 1.0 / (float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


@cuda.jit(device=True)
def _norm_rope(src, row, col0, dim, weight, freqs, position, eps, vals, buf):
    """Load src[row, col0:col0+dim] into vals, RMS-norm it with (1 + weight) and rotate
    its first 2 * len(freqs) dims by `position` (rotate-half). Leaves the result in vals."""
    t = cuda.threadIdx.x
    ur, ut = u32(row), u32(t)  # unsigned indices (all >= 0): no negative-index wraparound code
    ssq = _F32(0.0)
    for i in range(t, dim, THREADS):
        v = src[ur, u32(col0 + i)]
        vals[u32(i)] = v
        ssq += v * v
    total = block_sum(buf, ssq)
    inv = _F32(1.0) / math.sqrt(total / _F32(dim) + _F32(eps))
    for i in range(t, dim, THREADS):
        vals[u32(i)] = (vals[u32(i)] * inv) * (_F32(1.0) + weight[u32(i)])
    cuda.syncthreads()
    half = freqs.shape[0]
    a = np.float64(0.0)
    b = np.float64(0.0)
    c = np.float64(0.0)
    s = np.float64(0.0)
    if t < half:
        angle = np.float64(position) * freqs[ut]
        c = math.cos(angle)
        s = math.sin(angle)
        a = np.float64(vals[ut])
        b = np.float64(vals[u32(t + half)])
    cuda.syncthreads()
    if t < half:
        vals[ut] = _F32(a * c - b * s)
        vals[u32(t + half)] = _F32(b * c + a * s)
    cuda.syncthreads()


Q_HEADS_PER_BLOCK = 4
"""Query heads one block of `q_norm_rope` takes (THREADS threads each): a row's rotation
angles are worked out once for them all."""


@functools.cache
def _q_kernel_for(head_dim: int, half: int):
    """The query norm + RoPE kernel for heads of `head_dim` with `half` rotated pairs: a block
    takes Q_HEADS_PER_BLOCK heads of one row, THREADS threads a head. Each thread loads its
    dims t, t + THREADS, ... before it sums their squares (a thread that loaded, summed and
    loaded again had one load in flight: 0.73 TB/s at the 9B's 32K chunk, bench/RESULTS.md
    session 28); the sum is `_norm_rope`'s: from 0 in that order, then the tree over THREADS
    slots (its wide steps in shared memory, the last five as the xor butterfly, which adds
    the same pairs), so every bit is what one block per (row, head) gave."""
    n = -(-head_dim // THREADS)  # dims a thread holds
    group = Q_HEADS_PER_BLOCK
    warps = group * THREADS // 32
    pairs = max(half, 1)

    @fast
    @cuda.jit
    def _q_kernel(qg, weight, freqs, positions, eps, out):
        # qg: [rows, heads * 2 * head_dim] f32; positions: [rows] i32; out: [rows, heads, head_dim] f32
        tid = cuda.threadIdx.x
        g = tid // THREADS
        t = tid % THREADS
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y * group + g
        live = head < out.shape[1]
        col0 = (head if live else 0) * 2 * head_dim  # a group past the last head computes head 0, stores nothing
        vals = cuda.shared.array((group, head_dim), np.float32)
        buf = cuda.shared.array((group, THREADS), np.float32)
        angles = cuda.shared.array((2, pairs), np.float64)  # cos, sin of the row's angles
        scratch = cuda.shared.array((warps, 32), np.float32)  # the simulator's warp tree only
        x = cuda.local.array(n, np.float32)
        # unsigned indices (all >= 0): no negative-index wraparound code
        ur, ug, ut, utid = u32(row), u32(g), u32(t), u32(tid)
        for k in range(n):
            if t + k * THREADS < head_dim:
                x[k] = qg[ur, u32(col0 + t + k * THREADS)]
        ssq = _F32(0.0)
        for k in range(n):
            if t + k * THREADS < head_dim:
                ssq += x[k] * x[k]
        buf[ug, ut] = ssq
        if tid < half:
            angle = np.float64(positions[ur]) * freqs[utid]
            angles[0, utid] = math.cos(angle)
            angles[1, utid] = math.sin(angle)
        cuda.syncthreads()
        fold_wide(buf, g, 1)
        total = warp_sum(buf[ug, u32(t % 32)], scratch)
        inv = _F32(1.0) / math.sqrt(total / _F32(head_dim) + _F32(eps))
        for k in range(n):
            i = t + k * THREADS
            if i < head_dim:
                # weight[i] signed: with an unsigned index the compiler issued this loop's float
                # operations in another order (the same values; kept as they were)
                vals[ug, u32(i)] = (x[k] * inv) * (_F32(1.0) + weight[i])
        cuda.syncthreads()
        if t < half:  # thread t alone reads and writes dims t and t + half of its head
            a = np.float64(vals[ug, ut])
            b = np.float64(vals[ug, u32(t + half)])
            c = angles[0, ut]
            s = angles[1, ut]
            vals[ug, ut] = _F32(a * c - b * s)
            vals[ug, u32(t + half)] = _F32(b * c + a * s)
        cuda.syncthreads()
        if live:
            for k in range(n):
                i = t + k * THREADS
                if i < head_dim:
                    out[ur, u32(head), u32(i)] = vals[ug, u32(i)]

    return _q_kernel


def q_norm_rope(qg, weight, freqs, positions, eps: float, heads: int, head_dim: int, out=None, stream=0):
    """Query of each head: rope(rms_norm(query, weight, eps), positions).

    qg: f32 device [rows, heads * 2 * head_dim] (q_proj output: per head query then gate);
    weight: f32 [head_dim]; freqs: f64 [rotary_dim / 2] (`inv_freq`); positions: i32 [rows];
    out: None or f32 [rows, heads, head_dim]; returns it. Raises ValueError naming the argument
    when an array does not fit. Twins: ops.split_query_gate, ops.rms_norm, ops.rope.
    """
    check("qg", qg, np.float32, 2)
    check("positions", positions, np.int32, 1)
    rows = qg.shape[0]
    if qg.shape[1] != heads * 2 * head_dim or positions.shape[0] != rows:
        raise ValueError(f"qg {qg.shape} / positions {positions.shape} do not fit {heads} heads of {head_dim}")
    if head_dim > MAX_HEAD_DIM or 2 * freqs.shape[0] > head_dim or freqs.shape[0] > THREADS:
        raise ValueError(f"head_dim {head_dim} / rotary pairs {freqs.shape[0]} unsupported")
    if out is None:
        out = empty((rows, heads, head_dim), np.float32, stream)
    else:  # the kernel stores the heads of out.shape[1]: a wider out would read past qg's row
        check("out", out, np.float32, 3)
        if tuple(out.shape) != (rows, heads, head_dim):
            raise ValueError(f"out {tuple(out.shape)} must be [{rows}, {heads}, {head_dim}]")
    if rows:
        grid = (rows, -(-heads // Q_HEADS_PER_BLOCK))
        _q_kernel_for(head_dim, freqs.shape[0])[grid, Q_HEADS_PER_BLOCK * THREADS, stream](
            qg, weight, freqs, positions, eps, out)
    return out


@fast
@cuda.jit
def _kv_kernel(kv, weight, freqs, positions, slots, eps, kcache, vcache):
    # kv: [rows, 2 * kv_heads * head_dim] f32 (K columns, then V columns)
    # kcache, vcache: [slots, capacity_rows, kv_heads, head_dim] bf16
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    kv_heads = kcache.shape[2]
    head_dim = kcache.shape[3]
    ur = u32(row)  # unsigned indices (all >= 0): no negative-index wraparound code
    slot = slots[ur]
    if slot < 0:  # a padding row of a captured prefill (graphs.PrefillGraphs): no cache row
        return
    pos = positions[ur]
    t = cuda.threadIdx.x
    us, up, uh = u32(slot), u32(pos), u32(head)
    if cuda.blockIdx.z == 1:
        col0 = (kv_heads + head) * head_dim
        for i in range(t, head_dim, THREADS):
            vcache[us, up, uh, u32(i)] = f32_to_bf16(kv[ur, u32(col0 + i)])
        return
    vals = cuda.shared.array(MAX_HEAD_DIM, np.float32)
    buf = cuda.shared.array(THREADS, np.float32)
    _norm_rope(kv, row, head * head_dim, head_dim, weight, freqs, pos, eps, vals, buf)
    for i in range(t, head_dim, THREADS):
        kcache[us, up, uh, u32(i)] = f32_to_bf16(vals[u32(i)])


def kv_norm_rope_store(kv, weight, freqs, positions, slots, eps: float, kcache, vcache, stream=0):
    """Write bf16 rope(rms_norm(k)) and bf16 v of each row into the cache at
    [slots[r], positions[r]]; a row whose slot is negative (padding) writes nothing.

    kv: f32 device [rows, 2 * kv_heads * head_dim] (k_proj | v_proj output); weight: f32
    [head_dim] (k_norm); freqs: f64 [rotary_dim / 2]; positions, slots: i32 [rows];
    kcache, vcache: uint16 [slots, capacity_rows, kv_heads, head_dim] (one layer).
    Twins: ops.rms_norm, ops.rope (then rounded to bf16).
    """
    check("kv", kv, np.float32, 2)
    check("kcache", kcache, np.uint16, 4)
    check("vcache", vcache, np.uint16, 4)
    rows = kv.shape[0]
    _, capacity, kv_heads, head_dim = kcache.shape
    if kv.shape[1] != 2 * kv_heads * head_dim or positions.shape[0] != rows or slots.shape[0] != rows:
        raise ValueError(f"kv {kv.shape} / positions / slots do not fit the cache {kcache.shape}")
    if head_dim > MAX_HEAD_DIM or 2 * freqs.shape[0] > head_dim or freqs.shape[0] > THREADS:
        raise ValueError(f"head_dim {head_dim} / rotary pairs {freqs.shape[0]} unsupported")
    if rows:
        _kv_kernel[(rows, kv_heads, 2), THREADS, stream](kv, weight, freqs, positions, slots, eps, kcache, vcache)
