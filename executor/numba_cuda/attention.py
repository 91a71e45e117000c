"""Causal grouped-query attention over each stream's bf16 K/V cache, for prefill rows
(tiles of consecutive query rows) and decode lanes (one row each), with the sigmoid
output gate fused into the final combine.

Prefill: keys are visited in blocks of THREADS rows anchored at absolute row multiples
(one split from row 0); a query row's online-softmax sequence depends only on its own
position, never on the chunk or tile it sits in (key blocks past a row are masked and
leave its running sums exactly unchanged). Decode: one block per (lane, K/V head, split of
DECODE_SPLIT_ROWS keys anchored at row 0) serves every query head of the group, so each
K/V row is read once per lane; warp w takes keys w, w + 4, ... of the split, its lanes
own dimensions lane, lane + 32, ... (coalesced loads, a fixed butterfly sum per key), and
the four warps' softmax states merge in a fixed order. The split count follows the
context, never the batch; splits past a lane's position exit at once, so a larger
max_pos (a CUDA graph sized for the pool) changes no bit. Twins: ops.attention, then
ops.sigmoid_gate.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, THREADS, bf16_to_f32, check, empty, f32_to_bf16
from executor.numba_cuda.launch import fast

TILE_ROWS = 8
"""Query rows per prefill tile (they share each key block's loads)."""
MAX_HEAD_DIM = 256
_DIMS_PER_THREAD = MAX_HEAD_DIM // THREADS
DECODE_SPLIT_ROWS = 128
"""Keys per decode split (a constant: the split count depends on the context only)."""
MAX_GROUP = 8
"""Query heads per K/V head the decode kernel serves."""
WARP = 32
WARPS = THREADS // WARP
PREFILL_SPLIT_ROWS = 1 << 30
_F32 = np.float32
_NEG_INF = _F32(-np.inf)


@fast
@cuda.jit
def _partial_kernel(q, q_slot, q_pos, tile_rows, kcache, vcache, split_rows, m_out, l_out, o_out):
    # q: [nq, q_heads, head_dim] f32; q_slot, q_pos: [nq] i32 (a tile shares its slot;
    # positions rise within a tile); kcache, vcache: [slots, capacity, kv_heads, head_dim] bf16
    # m_out, l_out: [nq, q_heads, splits] f32; o_out: [nq, q_heads, splits, head_dim] f32
    tile = cuda.blockIdx.x
    head = cuda.blockIdx.y
    split = cuda.blockIdx.z
    t = cuda.threadIdx.x
    nq, q_heads, head_dim = q.shape
    kv_head = head // (q_heads // kcache.shape[2])
    r0 = tile * tile_rows
    nr = min(tile_rows, nq - r0)
    slot = q_slot[r0]
    key_lo = split * split_rows
    last = q_pos[r0 + nr - 1]
    if key_lo > last:
        return
    key_hi = min(key_lo + split_rows, last + 1)
    scale = _F32(1.0) / math.sqrt(_F32(head_dim))
    qt = cuda.shared.array((TILE_ROWS, MAX_HEAD_DIM), np.float32)
    p = cuda.shared.array((TILE_ROWS, THREADS), np.float32)
    red = cuda.shared.array((TILE_ROWS, THREADS), np.float32)
    for r in range(TILE_ROWS):
        for d in range(t, head_dim, THREADS):
            qt[r, d] = q[r0 + r, head, d] if r < nr else _F32(0.0)
    m = cuda.local.array(TILE_ROWS, np.float32)
    l = cuda.local.array(TILE_ROWS, np.float32)
    sc = cuda.local.array(TILE_ROWS, np.float32)
    acc = cuda.local.array((TILE_ROWS, _DIMS_PER_THREAD), np.float32)
    pos = cuda.local.array(TILE_ROWS, np.int32)
    for r in range(TILE_ROWS):
        m[r] = _NEG_INF
        l[r] = _F32(0.0)
        pos[r] = q_pos[r0 + r] if r < nr else np.int32(-1)
        for j in range(_DIMS_PER_THREAD):
            acc[r, j] = _F32(0.0)
    cuda.syncthreads()
    for kb in range(key_lo, key_hi, THREADS):
        key = kb + t
        for r in range(TILE_ROWS):
            sc[r] = _F32(0.0)
        if key < key_hi:
            for d in range(head_dim):
                kd = bf16_to_f32(kcache[slot, key, kv_head, d])
                for r in range(TILE_ROWS):
                    sc[r] += qt[r, d] * kd
        for r in range(TILE_ROWS):
            s = sc[r] * scale if key <= pos[r] and key < key_hi else _NEG_INF
            p[r, t] = s
            red[r, t] = s
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if t < step:
                for r in range(TILE_ROWS):
                    red[r, t] = max(red[r, t], red[r, t + step])
            cuda.syncthreads()
            step //= 2
        for r in range(TILE_ROWS):
            new_m = max(m[r], red[r, 0])
            e = _F32(0.0) if new_m == _NEG_INF else math.exp(p[r, t] - new_m)
            sc[r] = _F32(1.0) if new_m == _NEG_INF else math.exp(m[r] - new_m)
            m[r] = new_m
            p[r, t] = e
        cuda.syncthreads()
        for r in range(TILE_ROWS):
            red[r, t] = p[r, t]
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if t < step:
                for r in range(TILE_ROWS):
                    red[r, t] += red[r, t + step]
            cuda.syncthreads()
            step //= 2
        for r in range(TILE_ROWS):
            l[r] = l[r] * sc[r] + red[r, 0]
        count = min(THREADS, key_hi - kb)
        for j in range(_DIMS_PER_THREAD):
            d = t + j * THREADS
            if d < head_dim:
                for r in range(TILE_ROWS):
                    acc[r, j] *= sc[r]
                for i in range(count):
                    vd = bf16_to_f32(vcache[slot, kb + i, kv_head, d])
                    for r in range(TILE_ROWS):
                        acc[r, j] += p[r, i] * vd
        cuda.syncthreads()
    for r in range(TILE_ROWS):
        if r < nr and pos[r] >= key_lo:
            if t == 0:
                m_out[r0 + r, head, split] = m[r]
                l_out[r0 + r, head, split] = l[r]
            for j in range(_DIMS_PER_THREAD):
                d = t + j * THREADS
                if d < head_dim:
                    o_out[r0 + r, head, split, d] = acc[r, j]


if IS_SIMULATOR:

    def _warp_sum(value, scratch):
        """The sum of `value` over the warp's 32 lanes, in the butterfly's pairing (the
        simulator has no shuffles: a shared-memory tree, same pairs); every lane gets it."""
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        scratch[warp, lane] = value
        cuda.syncthreads()
        step = WARP // 2
        while step > 0:
            if lane < step:
                scratch[warp, lane] += scratch[warp, lane + step]
            cuda.syncthreads()
            step //= 2
        total = scratch[warp, 0]
        cuda.syncthreads()
        return total

else:

    @cuda.jit(device=True, inline=True)
    def _warp_sum(value, scratch):
        """The sum of `value` over the warp's 32 lanes (xor butterfly); every lane gets it."""
        for step in (16, 8, 4, 2, 1):
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
        return value


@functools.cache
def _decode_kernel(group: int, dims: int):
    """The decode partial kernel for `group` query heads per K/V head and `dims` dimensions
    per lane (head_dim <= 32 * dims)."""
    width = WARP * dims

    @fast
    @cuda.jit
    def kernel(q, q_slot, q_pos, kcache, vcache, split_rows, m_out, l_out, o_out):
        # q: [nq, q_heads, head_dim] f32; kcache, vcache: [slots, capacity, kv_heads, head_dim] bf16
        # m_out, l_out: [nq, q_heads, splits] f32; o_out: [nq, q_heads, splits, head_dim] f32
        row = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        split = cuda.blockIdx.z
        t = cuda.threadIdx.x
        lane = t % WARP
        warp = t // WARP
        head_dim = q.shape[2]
        pos = q_pos[row]
        key_lo = split * split_rows
        if key_lo > pos:
            return
        key_hi = key_lo + split_rows
        if key_hi > pos + 1:
            key_hi = pos + 1
        slot = q_slot[row]
        head0 = kv_head * group
        scale = _F32(1.0) / math.sqrt(_F32(head_dim))
        scratch = cuda.shared.array((WARPS, WARP), np.float32)
        qr = cuda.local.array((group, dims), np.float32)
        acc = cuda.local.array((group, dims), np.float32)
        m = cuda.local.array(group, np.float32)
        l = cuda.local.array(group, np.float32)
        kd = cuda.local.array(dims, np.float32)
        vd = cuda.local.array(dims, np.float32)
        for g in range(group):
            m[g] = _NEG_INF
            l[g] = _F32(0.0)
            for j in range(dims):
                d = lane + WARP * j
                qr[g, j] = q[row, head0 + g, d] * scale if d < head_dim else _F32(0.0)
                acc[g, j] = _F32(0.0)
        for base in range(key_lo, key_hi, WARPS):
            key = base + warp
            live = key < key_hi
            for j in range(dims):
                d = lane + WARP * j
                kd[j] = bf16_to_f32(kcache[slot, key, kv_head, d]) if live and d < head_dim else _F32(0.0)
                vd[j] = bf16_to_f32(vcache[slot, key, kv_head, d]) if live and d < head_dim else _F32(0.0)
            for g in range(group):
                s = _F32(0.0)
                for j in range(dims):
                    s += qr[g, j] * kd[j]
                s = _warp_sum(s, scratch)
                if live:
                    new_m = s if s > m[g] else m[g]
                    corr = math.exp(m[g] - new_m)
                    p = math.exp(s - new_m)
                    l[g] = l[g] * corr + p
                    for j in range(dims):
                        acc[g, j] = acc[g, j] * corr + p * vd[j]
                    m[g] = new_m
        sm_m = cuda.shared.array((WARPS, group), np.float32)
        sm_l = cuda.shared.array((WARPS, group), np.float32)
        sm_o = cuda.shared.array((WARPS, group, width), np.float32)
        for g in range(group):
            if lane == 0:
                sm_m[warp, g] = m[g]
                sm_l[warp, g] = l[g]
            for j in range(dims):
                sm_o[warp, g, lane + WARP * j] = acc[g, j]
        cuda.syncthreads()
        for i in range(t, group * head_dim, THREADS):
            g = i // head_dim
            d = i % head_dim
            top = _NEG_INF
            for w in range(WARPS):
                if sm_m[w, g] > top:
                    top = sm_m[w, g]
            total = _F32(0.0)
            o = _F32(0.0)
            for w in range(WARPS):
                e = math.exp(sm_m[w, g] - top)
                total += e * sm_l[w, g]
                o += e * sm_o[w, g, d]
            o_out[row, head0 + g, split, d] = o
            if d == 0:
                m_out[row, head0 + g, split] = top
                l_out[row, head0 + g, split] = total

    return kernel


@fast
@cuda.jit
def _combine_kernel(q_pos, split_rows, m_in, l_in, o_in, qg, out):
    # m_in, l_in: [nq, q_heads, splits]; o_in: [nq, q_heads, splits, head_dim] f32
    # qg: [nq, q_heads * 2 * head_dim] f32 (gate half per head); out: [nq, q_heads * head_dim] bf16
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    head_dim = o_in.shape[3]
    splits = q_pos[row] // split_rows + 1
    top = _NEG_INF
    for s in range(splits):
        top = max(top, m_in[row, head, s])
    total = _F32(0.0)
    for s in range(splits):
        total += math.exp(m_in[row, head, s] - top) * l_in[row, head, s]
    for d in range(cuda.threadIdx.x, head_dim, THREADS):
        o = _F32(0.0)
        for s in range(splits):
            o += math.exp(m_in[row, head, s] - top) * o_in[row, head, s, d]
        gate = qg[row, head * 2 * head_dim + head_dim + d]
        out[row, head * head_dim + d] = f32_to_bf16((o / total) / (_F32(1.0) + math.exp(-gate)))


def attention(
    q, q_slot, q_pos, max_pos: int, kcache, vcache, qg, tile_rows: int, split_rows: int, out=None, stream=0
):
    """out = bf16(sigmoid_gate(attention(q, K, V), gate)) for each query row against keys
    [0, q_pos[r]] of its stream's cache.

    q: f32 device [nq, q_heads, head_dim] (after QK-norm and RoPE); q_slot, q_pos: i32 [nq]
    (rows of one tile of `tile_rows` share a slot, positions rising); max_pos: the largest
    q_pos (host int; sizes the split grid); kcache, vcache: uint16
    [slots, capacity, kv_heads, head_dim] (one layer, rows [0, q_pos] already written);
    qg: f32 [nq, q_heads * 2 * head_dim] (q_proj output; its gate halves are read);
    tile_rows: TILE_ROWS for prefill, 1 for decode; split_rows: PREFILL_SPLIT_ROWS or
    DECODE_SPLIT_ROWS. Returns uint16 (bf16) [nq, q_heads * head_dim].
    Twins: ops.attention, then ops.sigmoid_gate.
    """
    check("q", q, np.float32, 3)
    check("kcache", kcache, np.uint16, 4)
    check("vcache", vcache, np.uint16, 4)
    check("qg", qg, np.float32, 2)
    nq, q_heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM or kcache.shape[3] != head_dim or q_heads % kcache.shape[2] or (
        q_heads // kcache.shape[2] > MAX_GROUP
    ):
        raise ValueError(f"q {q.shape} does not fit the cache {kcache.shape}")
    if not 1 <= tile_rows <= TILE_ROWS or tuple(qg.shape) != (nq, q_heads * 2 * head_dim):
        raise ValueError(f"tile_rows {tile_rows} / qg {qg.shape} unsupported")
    out = empty((nq, q_heads * head_dim), np.uint16, stream) if out is None else out
    if not nq:
        return out
    splits = int(max_pos) // split_rows + 1
    m = empty((nq, q_heads, splits), np.float32, stream)
    l_sum = empty((nq, q_heads, splits), np.float32, stream)
    o = empty((nq, q_heads, splits, head_dim), np.float32, stream)
    if tile_rows == 1:
        kv_heads = kcache.shape[2]
        kernel = _decode_kernel(q_heads // kv_heads, (head_dim + WARP - 1) // WARP)
        kernel[(nq, kv_heads, splits), THREADS, stream](q, q_slot, q_pos, kcache, vcache, split_rows, m, l_sum, o)
    else:
        tiles = (nq + tile_rows - 1) // tile_rows
        _partial_kernel[(tiles, q_heads, splits), THREADS, stream](
            q, q_slot, q_pos, tile_rows, kcache, vcache, split_rows, m, l_sum, o
        )
    _combine_kernel[(nq, q_heads), THREADS, stream](q_pos, split_rows, m, l_sum, o, qg, out)
    return out
