"""QK-norm and partial RoPE of the gated attention, and the K/V write into the cache.

`q_norm_rope` reads the query half of each head of the q_proj output (the gate half is
read later by attention's combine); `kv_norm_rope_store` norms and rotates K, and writes
K and V as bf16 at their absolute rows in a stream's cache. Twins: ops.split_query_gate,
ops.rms_norm (QK-norm), ops.rope. Angles in float64. A block takes ROWS_PER_BLOCK rows (one
row up to FEW_ROWS rows) of Q_HEADS_PER_BLOCK query heads or K/V heads, THREADS threads a
head: every bit the same as one block per (row, head).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import THREADS, check, empty, f32_to_bf16
from executor.numba_cuda.launch import fast
from executor.numba_cuda.norms import fold_wide, warp_sum

MAX_HEAD_DIM = 512
_F32 = np.float32


def inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """float64 [rotary_dim / 2]: theta^(-2i / rotary_dim), as in ops.rope."""
    return 1.0 / (float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


Q_HEADS_PER_BLOCK = 4
"""Query heads one block of `q_norm_rope` takes (THREADS threads each): a row's rotation
angles are worked out once for them all."""

ROWS_PER_BLOCK = 8
"""Rows one block of `q_norm_rope` and `kv_norm_rope_store` takes in a prefill, one after the
other, each row's loads issued while the row before it is normed, rotated and stored (its
latency hidden behind that work instead of stalling a block that has nothing else to do).
A row's bits do not depend on it: each row goes through the same operations in the same
order. Chunks of at most FEW_ROWS rows (decode rounds, short chunks) take one row a block,
so that they keep as many blocks as rows. H100, 9B, 32K rows (bench/RESULTS.md, session
37), q / K+V ms: one row a block, before 0.792 / 0.424; rows a block 1, 2, 4, 8: 1.082 /
0.335, 0.886 / 0.290, 0.753 / 0.256, 0.683 / 0.248, all the same bytes. One row a block has
been compiled without the prefetch since (rows a block is a compile-time constant), unmeasured."""

FEW_ROWS = 1024
"""Row count up to which the kernels take one row a block (see ROWS_PER_BLOCK)."""


def rows_per_block(rows: int) -> int:
    """Rows a block of `q_norm_rope` / `kv_norm_rope_store` takes for a chunk of `rows` rows."""
    return 1 if rows <= FEW_ROWS else ROWS_PER_BLOCK


@cuda.jit(device=True, inline=True)
def _row_norm_rope(x, g, t, tid, half, dim, n, weight, freqs, position, eps, vals, buf, angles, scratch):
    """Norm and rotate one row's head of group g (THREADS threads t of it) whose elements t,
    t + THREADS, ... are in x: rms_norm with (1 + weight), then rotate-half of the first
    2 * half dims by `position` with float64 angles (tid < half work them out, once for the
    block's groups). Leaves the result in vals[g]; every thread of the block calls it. The
    sum of squares is each thread's own elements from 0 in order, then the fixed tree over
    THREADS slots (fold_wide's wide steps, the xor butterfly for the last five: the same
    pairs as `block_sum`'s tree), so the bits are those of one THREADS-thread block per (row,
    head) summing with `block_sum` (K's kernel before session 37; q's already summed this way).
    Ends on a barrier, after which vals[g] may be read and buf and angles written again."""
    ug, ut, utid = u32(g), u32(t), u32(tid)
    ssq = _F32(0.0)
    for k in range(n):
        if t + k * THREADS < dim:
            ssq += x[k] * x[k]
    buf[ug, ut] = ssq
    if tid < half:
        angle = np.float64(position) * freqs[utid]
        angles[0, utid] = math.cos(angle)
        angles[1, utid] = math.sin(angle)
    cuda.syncthreads()
    fold_wide(buf, g, 1)
    total = warp_sum(buf[ug, u32(t % 32)], scratch)
    inv = _F32(1.0) / math.sqrt(total / _F32(dim) + _F32(eps))
    for k in range(n):
        i = t + k * THREADS
        if i < dim:
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


@functools.cache
def _q_kernel_for(head_dim: int, half: int, per_block: int):
    """The query norm + RoPE kernel for heads of `head_dim` with `half` rotated pairs: a block
    takes Q_HEADS_PER_BLOCK heads of `per_block` consecutive rows (`rows_per_block`; a
    compile-time constant, so one row a block has no prefetch code), THREADS threads a head. Each thread loads its dims t, t + THREADS, ... before it sums their
    squares (a thread that loaded, summed and loaded again had one load in flight: 0.73 TB/s
    at the 9B's 32K chunk, bench/RESULTS.md session 28), and loads the next row's while this
    row is normed, rotated and stored (`_row_norm_rope`): every bit is what one block per
    (row, head) gave."""
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
        head = cuda.blockIdx.y * group + g
        live = head < out.shape[1]
        col0 = (head if live else 0) * 2 * head_dim  # a group past the last head computes head 0, stores nothing
        first = cuda.blockIdx.x * per_block
        end = min(first + per_block, qg.shape[0])
        vals = cuda.shared.array((group, head_dim), np.float32)
        buf = cuda.shared.array((group, THREADS), np.float32)
        angles = cuda.shared.array((2, pairs), np.float64)  # cos, sin of the row's angles
        scratch = cuda.shared.array((warps, 32), np.float32)  # the simulator's warp tree only
        x = cuda.local.array(n, np.float32)
        nxt = cuda.local.array(n, np.float32)
        ug = u32(g)  # unsigned indices (all >= 0): no negative-index wraparound code
        for k in range(n):
            if t + k * THREADS < head_dim:
                nxt[k] = qg[u32(first), u32(col0 + t + k * THREADS)]
        for row in range(first, end):
            ur = u32(row)
            for k in range(n):
                x[k] = nxt[k]
            if per_block > 1 and row + 1 < end:  # the next row's loads, in flight while this row is worked
                for k in range(n):
                    if t + k * THREADS < head_dim:
                        nxt[k] = qg[u32(row + 1), u32(col0 + t + k * THREADS)]
            _row_norm_rope(x, g, t, tid, half, head_dim, n, weight, freqs, positions[ur], eps, vals, buf, angles,
                           scratch)
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
        per_block = rows_per_block(rows)
        grid = (-(-rows // per_block), -(-heads // Q_HEADS_PER_BLOCK))
        _q_kernel_for(head_dim, freqs.shape[0], per_block)[grid, Q_HEADS_PER_BLOCK * THREADS, stream](
            qg, weight, freqs, positions, eps, out)
    return out


@functools.cache
def _kv_kernel_for(head_dim: int, half: int, kv_heads: int, per_block: int):
    """The K norm + RoPE + cache store kernel: a block takes up to Q_HEADS_PER_BLOCK K/V heads
    (every one of the presets') of `per_block` consecutive rows (`rows_per_block`; a
    compile-time constant, so one row a block has no prefetch code), THREADS threads a head,
    each thread its dims t, t + THREADS, ... of K and of V, the next row's loaded while this one
    is worked; K goes through `_row_norm_rope` (the same bits as one block per (row, head)), V
    is rounded as it is. A row's angles are worked out once for the block's heads."""
    n = -(-head_dim // THREADS)  # dims a thread holds
    group = min(kv_heads, Q_HEADS_PER_BLOCK)
    warps = group * THREADS // 32
    pairs = max(half, 1)

    @fast
    @cuda.jit
    def _kv_kernel(kv, weight, freqs, positions, slots, eps, kcache, vcache):
        # kv: [rows, 2 * kv_heads * head_dim] f32 (K columns, then V columns)
        # kcache, vcache: [slots, capacity_rows, kv_heads, head_dim] bf16
        tid = cuda.threadIdx.x
        g = tid // THREADS
        t = tid % THREADS
        head = cuda.blockIdx.y * group + g
        live = head < kv_heads
        if not live:  # a group past the last head computes head 0 (for the barriers), stores nothing
            head = 0
        k0 = head * head_dim
        v0 = (kv_heads + head) * head_dim
        first = cuda.blockIdx.x * per_block
        end = min(first + per_block, kv.shape[0])
        vals = cuda.shared.array((group, head_dim), np.float32)
        buf = cuda.shared.array((group, THREADS), np.float32)
        angles = cuda.shared.array((2, pairs), np.float64)
        scratch = cuda.shared.array((warps, 32), np.float32)  # the simulator's warp tree only
        x = cuda.local.array(n, np.float32)
        nxt = cuda.local.array(n, np.float32)
        vx = cuda.local.array(n, np.float32)
        ug, uh = u32(g), u32(head)  # unsigned indices (all >= 0): no negative-index wraparound code
        for k in range(n):
            if t + k * THREADS < head_dim:
                nxt[k] = kv[u32(first), u32(k0 + t + k * THREADS)]
                vx[k] = kv[u32(first), u32(v0 + t + k * THREADS)]
        for row in range(first, end):
            ur = u32(row)
            for k in range(n):
                x[k] = nxt[k]
            slot = slots[ur]
            pos = positions[ur]
            if slot >= 0 and live:  # else a padding row of a captured prefill (graphs.PrefillGraphs): no cache row
                us, up = u32(slot), u32(pos)
                for k in range(n):
                    i = t + k * THREADS
                    if i < head_dim:
                        vcache[us, up, uh, u32(i)] = f32_to_bf16(vx[k])
            if per_block > 1 and row + 1 < end:  # the next row's loads, in flight while this row is worked
                for k in range(n):
                    if t + k * THREADS < head_dim:
                        nxt[k] = kv[u32(row + 1), u32(k0 + t + k * THREADS)]
                        vx[k] = kv[u32(row + 1), u32(v0 + t + k * THREADS)]
            if slot >= 0:  # the same for every thread of the block: its barriers are safe
                _row_norm_rope(x, g, t, tid, half, head_dim, n, weight, freqs, pos, eps, vals, buf, angles, scratch)
                if live:
                    us, up = u32(slot), u32(pos)
                    for k in range(n):
                        i = t + k * THREADS
                        if i < head_dim:
                            kcache[us, up, uh, u32(i)] = f32_to_bf16(vals[ug, u32(i)])

    return _kv_kernel


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
        per_block = rows_per_block(rows)
        group = min(kv_heads, Q_HEADS_PER_BLOCK)
        grid = (-(-rows // per_block), -(-kv_heads // group))
        _kv_kernel_for(head_dim, freqs.shape[0], kv_heads, per_block)[grid, group * THREADS, stream](
            kv, weight, freqs, positions, slots, eps, kcache, vcache)
