"""Causal grouped-query attention over each stream's bf16 K/V cache, for prefill rows
(tiles of consecutive query rows) and decode lanes (one row each), with the sigmoid
output gate fused into the final combine.

Prefill: keys are visited in blocks of THREADS rows anchored at absolute row multiples
(one split from row 0); a query row's online-softmax sequence depends only on its own
position, never on the chunk or tile it sits in (key blocks past a row are masked and
leave its running sums exactly unchanged). Decode: one block per (lane, K/V head, split of
DECODE_SPLIT_ROWS keys anchored at row 0) serves every query head of the group, so each
K/V row is read once per lane. Lane l holds dimensions 8l .. 8l + 7 (one 16-byte load of a
K or V row); each warp loads DECODE_KEYS_IN_FLIGHT keys before it uses them. Three phases
per split: every key's score for every head of the group (a fixed butterfly sum), the
split's exact softmax (its max, then exp(s - max) and their sum), then P V with each warp
summing its keys in ascending order and the warps' sums added in a fixed order. The
combine merges the splits (a fixed tree for the max and the denominator, ascending splits
for the output) and applies the gate. The split count follows the context, never the
batch; splits past a lane's position exit at once, so a larger max_pos (a CUDA graph sized
for the pool) changes no bit. Twins: ops.attention, then ops.sigmoid_gate.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import IS_SIMULATOR, THREADS, bf16_to_f32, check, empty, f32_to_bf16
from executor.numba_cuda.gemv import WORD, bf16_hi, bf16_lo, vector_load
from executor.numba_cuda.launch import fast
from executor.numba_cuda.norms import block_sum
from executor.numba_cuda.norms import warp_max as _warp_max
from executor.numba_cuda.norms import warp_sum as _warp_sum

TILE_ROWS = 8
"""Query rows per prefill tile (they share each key block's loads)."""
MAX_HEAD_DIM = 256
_DIMS_PER_THREAD = MAX_HEAD_DIM // THREADS
DECODE_SPLIT_ROWS = 128
"""Keys per decode split (a constant: the split count depends on the context only)."""
MAX_DECODE_SPLIT_ROWS = 256
"""The largest decode split: its scores (4 bytes x group x split) and the warps' partial outputs
(4 bytes x 4 warps x group x head_dim) share the 48 KB of static shared memory."""
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


DECODE_KEYS_IN_FLIGHT = 4
"""Keys whose 16-byte K (or V) loads each warp issues before it uses the first."""


@functools.cache
def _decode_kernel(group: int, chunks: int, split_rows: int):
    """The decode partial kernel for `group` query heads per K/V head, head_dim = 8 x
    `chunks` (lane l holds dimensions 8l .. 8l + 7: one 16-byte load of a K or V row),
    and `split_rows` keys per split."""
    head_dim = 8 * chunks
    in_flight = DECODE_KEYS_IN_FLIGHT
    per_pass = WARPS * in_flight

    @fast
    @cuda.jit
    def kernel(q, q_slot, q_pos, k32, v32, capacity, kv_heads, m_out, l_out, o_out):
        # q: [nq, q_heads, head_dim] f32; k32, v32: one layer's cache [slots, capacity, kv_heads,
        # head_dim] bf16 as flat WORD words (vector_load indexes uint32 words)
        # m_out, l_out: [nq, q_heads, splits] f32; o_out: [nq, q_heads, splits, head_dim] f32
        row = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        split = cuda.blockIdx.z
        t = cuda.threadIdx.x
        lane = t % WARP
        warp = t // WARP
        # unsigned indices (all >= 0): no negative-index wraparound code; the flat K/V word
        # index `base + j * key_words` stays 64-bit (a layer's cache may pass 2^32 words)
        ur, usplit, uwarp = u32(row), u32(split), u32(warp)
        pos = q_pos[ur]
        key_lo = split * split_rows
        if key_lo > pos:
            return
        n = pos + 1 - key_lo
        if n > split_rows:
            n = split_rows
        slot = q_slot[ur]
        head0 = kv_head * group
        active = lane < chunks
        scale = _F32(1.0) / math.sqrt(_F32(head_dim))
        scores = cuda.shared.array((group, split_rows), np.float32)  # then exp(s - m)
        partial = cuda.shared.array((WARPS, group, head_dim), np.float32)
        scratch = cuda.shared.array((WARPS, WARP), np.float32)
        qr = cuda.local.array((group, 8), np.float32)
        for g in range(group):
            for e in range(8):
                qr[g, e] = q[ur, u32(head0 + g), u32(8 * lane + e)] * scale if active else _F32(0.0)
        row_words = head_dim // 2
        key_words = kv_heads * row_words
        base = ((slot * capacity + key_lo) * kv_heads + kv_head) * row_words + 4 * lane
        words = cuda.local.array((in_flight, 4), np.uint32)
        # scores: warp w takes keys p0 + w * in_flight + u of each pass; a fixed butterfly per key
        for p0 in range(0, n, per_pass):
            for u in range(in_flight):
                j = p0 + warp * in_flight + u
                if active and j < n:
                    w4 = vector_load(k32, base + j * key_words)
                    for i in range(4):
                        words[u, i] = w4[i]
                else:
                    for i in range(4):
                        words[u, i] = np.uint32(0)
            for u in range(in_flight):
                j = p0 + warp * in_flight + u
                for g in range(group):
                    s = _F32(0.0)
                    for i in range(4):
                        s = cuda.fma(qr[g, 2 * i], bf16_lo(words[u, i]), s)
                        s = cuda.fma(qr[g, 2 * i + 1], bf16_hi(words[u, i]), s)
                    s = _warp_sum(s, scratch)
                    if lane == 0 and j < n:
                        scores[u32(g), u32(j)] = s
        cuda.syncthreads()
        # softmax over the split's keys: warp w takes heads w, w + WARPS, ...
        for g0 in range(0, group, WARPS):
            g = g0 + warp
            top = _NEG_INF
            ug = u32(g)
            if g < group:
                for j in range(lane, n, WARP):
                    top = max(top, scores[ug, u32(j)])
            top = _warp_max(top, scratch)
            total = _F32(0.0)
            if g < group:
                for j in range(lane, n, WARP):
                    e = math.exp(scores[ug, u32(j)] - top)
                    scores[ug, u32(j)] = e
                    total += e
            total = _warp_sum(total, scratch)
            if g < group and lane == 0:
                m_out[ur, u32(head0 + g), usplit] = top
                l_out[ur, u32(head0 + g), usplit] = total
        cuda.syncthreads()
        # P V: each warp its keys in ascending order, then the warps' sums in a fixed order
        acc = cuda.local.array((group, 8), np.float32)
        for g in range(group):
            for e in range(8):
                acc[g, e] = _F32(0.0)
        for p0 in range(0, n, per_pass):
            for u in range(in_flight):
                j = p0 + warp * in_flight + u
                if active and j < n:
                    w4 = vector_load(v32, base + j * key_words)
                    for i in range(4):
                        words[u, i] = w4[i]
            for u in range(in_flight):
                j = p0 + warp * in_flight + u
                if active and j < n:
                    for g in range(group):
                        p = scores[u32(g), u32(j)]
                        for i in range(4):
                            acc[g, 2 * i] = cuda.fma(p, bf16_lo(words[u, i]), acc[g, 2 * i])
                            acc[g, 2 * i + 1] = cuda.fma(p, bf16_hi(words[u, i]), acc[g, 2 * i + 1])
        if active:
            for g in range(group):
                for e in range(8):
                    partial[uwarp, u32(g), u32(8 * lane + e)] = acc[g, e]
        cuda.syncthreads()
        for i in range(t, group * head_dim, THREADS):
            g = i // head_dim
            d = i % head_dim
            o = partial[0, g, d]
            for w in range(1, WARPS):
                o += partial[w, g, d]
            o_out[ur, u32(head0 + g), usplit, u32(d)] = o

    return kernel


COMBINE_IN_FLIGHT = 4
"""Splits whose partial outputs each thread loads before it adds the first."""


@fast
@cuda.jit
def _combine_kernel(q_pos, split_rows, m_in, l_in, o_in, qg, out):
    # m_in, l_in: [nq, q_heads, splits]; o_in: [nq, q_heads, splits, head_dim] f32
    # qg: [nq, q_heads * 2 * head_dim] f32 (gate half per head); out: [nq, q_heads * head_dim] bf16
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    t = cuda.threadIdx.x
    ur, uh, ut = u32(row), u32(head), u32(t)  # unsigned indices (all >= 0): no wraparound code
    head_dim = o_in.shape[3]
    splits = q_pos[ur] // split_rows + 1
    red = cuda.shared.array(THREADS, np.float32)
    weights = cuda.shared.array(THREADS, np.float32)
    top = _NEG_INF
    for s in range(t, splits, THREADS):
        top = max(top, m_in[ur, uh, u32(s)])
    red[ut] = top
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            red[ut] = max(red[ut], red[u32(t + step)])
        cuda.syncthreads()
        step //= 2
    top = red[0]
    cuda.syncthreads()
    part = _F32(0.0)
    for s in range(t, splits, THREADS):
        part += math.exp(m_in[ur, uh, u32(s)] - top) * l_in[ur, uh, u32(s)]
    total = block_sum(red, part)
    o = cuda.local.array(_DIMS_PER_THREAD, np.float32)
    x = cuda.local.array(COMBINE_IN_FLIGHT, np.float32)
    for j in range(_DIMS_PER_THREAD):
        o[j] = _F32(0.0)
    for c0 in range(0, splits, THREADS):
        cuda.syncthreads()
        s = c0 + t
        weights[ut] = math.exp(m_in[ur, uh, u32(s)] - top) if s < splits else _F32(0.0)
        cuda.syncthreads()
        count = min(THREADS, splits - c0)
        for j in range(_DIMS_PER_THREAD):
            d = t + j * THREADS
            if d < head_dim:
                ud = u32(d)
                i = 0
                while i + COMBINE_IN_FLIGHT <= count:
                    for u in range(COMBINE_IN_FLIGHT):
                        x[u] = o_in[ur, uh, u32(c0 + i + u), ud]
                    for u in range(COMBINE_IN_FLIGHT):
                        o[j] += weights[u32(i + u)] * x[u]
                    i += COMBINE_IN_FLIGHT
                while i < count:
                    o[j] += weights[u32(i)] * o_in[ur, uh, u32(c0 + i), ud]
                    i += 1
    for j in range(_DIMS_PER_THREAD):
        d = t + j * THREADS
        if d < head_dim:
            gate = qg[ur, u32(head * 2 * head_dim + head_dim + d)]
            out[ur, u32(head * head_dim + d)] = f32_to_bf16((o[j] / total) / (_F32(1.0) + math.exp(-gate)))


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
    DECODE_SPLIT_ROWS. Returns uint16 (bf16) [nq, q_heads * head_dim]. Decode needs
    head_dim % 8 == 0, split_rows <= MAX_DECODE_SPLIT_ROWS and C-contiguous caches (K/V
    rows 16-byte aligned); ValueError otherwise.
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
    if tile_rows == 1 and (head_dim % 8 or not 1 <= split_rows <= MAX_DECODE_SPLIT_ROWS or not (
            kcache.is_c_contiguous() and vcache.is_c_contiguous())):
        raise ValueError(f"decode needs head_dim % 8 == 0 (got {head_dim}), split_rows in [1, "
                         f"{MAX_DECODE_SPLIT_ROWS}] (got {split_rows}) and C-contiguous caches")
    out = empty((nq, q_heads * head_dim), np.uint16, stream) if out is None else out
    if not nq:
        return out
    splits = int(max_pos) // split_rows + 1
    m = empty((nq, q_heads, splits), np.float32, stream)
    l_sum = empty((nq, q_heads, splits), np.float32, stream)
    o = empty((nq, q_heads, splits, head_dim), np.float32, stream)
    if tile_rows == 1:
        slots, capacity, kv_heads, _ = kcache.shape
        k32 = kcache.reshape(kcache.size).view(WORD)
        v32 = vcache.reshape(vcache.size).view(WORD)
        kernel = _decode_kernel(q_heads // kv_heads, head_dim // 8, split_rows)
        kernel[(nq, kv_heads, splits), THREADS, stream](q, q_slot, q_pos, k32, v32, capacity, kv_heads, m, l_sum, o)
    else:
        tiles = (nq + tile_rows - 1) // tile_rows
        _partial_kernel[(tiles, q_heads, splits), THREADS, stream](
            q, q_slot, q_pos, tile_rows, kcache, vcache, split_rows, m, l_sum, o
        )
    _combine_kernel[(nq, q_heads), THREADS, stream](q_pos, split_rows, m, l_sum, o, qg, out)
    return out
