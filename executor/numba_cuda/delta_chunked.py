"""The chunked (UT transform) gated delta rule for one stream's prefill chunk: sub-chunks of
64 rows anchored at absolute multiples of 64, each computed from its own rows and the
incoming fp32 state, so any chunking cut on that 64-row grid gives the same bits (DESIGN:
invariant grid), not other cuts. Decode (one row per lane) and the gates are in
delta_rule.py, q and k's L2 norm in conv.causal_conv1d_qkv. Twin: ops.gated_delta_rule_chunked.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, THREADS, check, empty
from executor.numba_cuda.launch import fast

MAX_KEY_DIM = 256
_F32 = np.float32

SUBCHUNK_ROWS = 64
"""Rows per sub-chunk, anchored at absolute row multiples (ops.DELTA_SUBCHUNK_ROWS)."""
PHASE1_VALUE_HEADS = 1
"""Value heads one phase-1 block handles (0: a key head's whole group). With one, a 64-row
sub-chunk of the 27B shape runs 48 blocks instead of 16 (a short chunk's phase 1 is a
chain of dependent steps per value head, not a throughput problem); each block recomputes
its key head's Gram matrices with the same operations in the same order, so the bits do
not depend on this."""
STATE_COLS = 16
"""Value columns of the state one phase-2 block owns (16 or 32: more blocks vs more reuse)."""
STATE_THREADS = THREADS
"""Threads of a phase-2 block (64 or 128 with 16 columns: more reuse vs more warps)."""
_C = SUBCHUNK_ROWS
_PAD = _C + 1  # row stride of the [C, C] shared matrices
_TILE = 32  # key dims per staged q/k tile; T and M T columns per staged tile
_TW = _TILE + 1  # row stride of a staged tile
_TILE_SIZE = _C * _TW
_TILE_LOADS = _C * _TILE // THREADS  # elements of a [C, _TILE] tile each phase-1 thread stages
_TILE_ROW_STEP = THREADS // _TILE
_GRAM_ROWS = _C // (THREADS // 8)  # rows of the [C, C] products a phase-1 thread owns
_GRAM_BUF = 2 * _C * _PAD
_UPDATE_ROWS = 16  # sub-chunk rows per staged k tile of the phase-2 state update
_STATE_MAX_REGISTERS = 168  # phase 2, <= 16 columns, key_dim <= 128: 3 blocks per SM, no spill
if IS_SIMULATOR:

    def _U(index):
        """The index itself (Python ints: numpy scalars are slow in the simulator)."""
        return index

else:
    _U = np.uint64
    """Hot loops index with uint64: numba emits no negative-index wraparound for unsigned."""


@functools.cache
def _subchunk_kernel(key_heads: int, key_dim: int, per_block: int):
    """Phase 1 for q and k of `key_heads` heads of `key_dim`: one block per (sub-chunk,
    `per_block` value heads of one key head: blockIdx.y = key head * blocks per key head +
    which); thread t owns rows r0 + a (a < _GRAM_ROWS) and columns t % 8 + 8 b (b < 8) of
    the [C, C] products. qn and kn come flat ([rows * key_heads * key_dim])."""
    row_len = key_heads * key_dim

    @fast
    @cuda.jit
    def kernel(qn, kn, g, beta, off, tmats, din, dout):
        # qn, kn: flat [rows, key_heads, key_dim] f32; g, beta: [rows, value_heads] f32
        # tmats: flat [subchunks, value_heads, 2, C, C] f32 (T, then M T)
        # din, dout: [rows, value_heads] f32 (exp(c_i), exp(c_last - c_i))
        s = cuda.blockIdx.x
        t = cuda.threadIdx.x
        rows = g.shape[0]
        group = g.shape[1] // key_heads
        blocks = group // per_block  # blocks per key head
        kh = cuda.blockIdx.y // blocks
        vh0 = cuda.blockIdx.y % blocks * per_block
        lo = max(0, s * _C - off)
        n = min(rows, (s + 1) * _C - off) - lo
        buf = cuda.shared.array(_GRAM_BUF, np.float32)  # [C, C] A, M, M T | [C, C] T; q/k tiles first
        cum = cuda.shared.array(_C, np.float32)
        bet = cuda.shared.array(_C, np.float32)
        tb = _C * _PAD
        r0 = (t // 8) * _GRAM_ROWS
        cj = t % 8
        kk_acc = cuda.local.array((_GRAM_ROWS, 8), np.float32)
        qk_acc = cuda.local.array((_GRAM_ROWS, 8), np.float32)
        mt = cuda.local.array((_GRAM_ROWS, 8), np.float32)
        vec = cuda.local.array(8, np.float32)
        for a in range(_GRAM_ROWS):
            for b in range(8):
                kk_acc[a, b] = _F32(0.0)
                qk_acc[a, b] = _F32(0.0)
        sd = t % _TILE
        si = t // _TILE
        urow = _U(r0 * _TW)
        ucol = _U(cj * _TW)
        for k0 in range(0, key_dim, _TILE):  # Gram matrices k.k and q.k of the key head
            width = min(_TILE, key_dim - k0)
            src = _U(lo * row_len + kh * key_dim + k0 + min(sd, width - 1))
            for r in range(_TILE_LOADS):  # rows past n, dims past width: copies, never read
                i = si + _TILE_ROW_STEP * r
                at = src + _U(min(i, n - 1) * row_len)
                dst = _U(i * _TW + sd)
                buf[dst] = kn[at]
                buf[dst + _U(_TILE_SIZE)] = qn[at]
            cuda.syncthreads()
            d = 0
            while d < width:
                for b in range(8):
                    vec[b] = buf[ucol + _U(8 * b * _TW + d)]
                for a in range(_GRAM_ROWS):
                    ki = buf[urow + _U(a * _TW + d)]
                    qi = buf[urow + _U(_TILE_SIZE + a * _TW + d)]
                    for b in range(8):
                        kk_acc[a, b] += ki * vec[b]
                        qk_acc[a, b] += qi * vec[b]
                d += 1
            cuda.syncthreads()
        for vh in range(vh0, vh0 + per_block):
            hv = kh * group + vh
            if t < _C:
                cum[t] = g[lo + t, hv] if t < n else _F32(0.0)
                bet[t] = beta[lo + t, hv] if t < n else _F32(0.0)
            cuda.syncthreads()
            if t == 0:
                c = _F32(0.0)
                for i in range(n):
                    c += cum[i]
                    cum[i] = c
            cuda.syncthreads()
            last = cum[n - 1]
            if t < n:
                din[lo + t, hv] = math.exp(cum[t])
                dout[lo + t, hv] = math.exp(last - cum[t])
            for a in range(_GRAM_ROWS):  # A = strict_lower(beta_i k_i.k_j exp(c_i - c_j))
                i = r0 + a
                for b in range(8):
                    j = cj + 8 * b
                    live = j < i < n
                    buf[i * _PAD + j] = bet[i] * kk_acc[a, b] * math.exp(cum[i] - cum[j]) if live else _F32(0.0)
            cuda.syncthreads()
            if t < _C:  # T = (I + A)^-1 by forward substitution, one column per thread
                for i in range(_C):
                    buf[tb + i * _PAD + t] = _F32(1.0) if i == t else _F32(0.0)
                for i in range(t + 1, n):  # four partial sums: a quarter of the dependent chain
                    acc0 = _F32(0.0)
                    acc1 = _F32(0.0)
                    acc2 = _F32(0.0)
                    acc3 = _F32(0.0)
                    j = t
                    while j + 3 < i:
                        acc0 += buf[_U(i * _PAD + j)] * buf[_U(tb + j * _PAD + t)]
                        acc1 += buf[_U(i * _PAD + j + 1)] * buf[_U(tb + (j + 1) * _PAD + t)]
                        acc2 += buf[_U(i * _PAD + j + 2)] * buf[_U(tb + (j + 2) * _PAD + t)]
                        acc3 += buf[_U(i * _PAD + j + 3)] * buf[_U(tb + (j + 3) * _PAD + t)]
                        j += 4
                    while j < i:
                        acc0 += buf[_U(i * _PAD + j)] * buf[_U(tb + j * _PAD + t)]
                        j += 1
                    buf[tb + i * _PAD + t] = -((acc0 + acc1) + (acc2 + acc3))
            cuda.syncthreads()
            for a in range(_GRAM_ROWS):  # M = lower_incl(q_i.k_j exp(c_i - c_j)), over A
                i = r0 + a
                for b in range(8):
                    j = cj + 8 * b
                    live = j <= i < n
                    buf[i * _PAD + j] = qk_acc[a, b] * math.exp(cum[i] - cum[j]) if live else _F32(0.0)
                    mt[a, b] = _F32(0.0)
            cuda.syncthreads()
            j = 0
            while j < min(r0 + _GRAM_ROWS, n):  # M T
                for b in range(8):
                    vec[b] = buf[_U(tb + j * _PAD + cj + 8 * b)]
                for a in range(_GRAM_ROWS):
                    m = buf[_U((r0 + a) * _PAD + j)]
                    for b in range(8):
                        mt[a, b] += m * vec[b]
                j += 1
            cuda.syncthreads()
            for a in range(_GRAM_ROWS):
                for b in range(8):
                    buf[(r0 + a) * _PAD + cj + 8 * b] = mt[a, b]
            cuda.syncthreads()
            base = (s * g.shape[1] + hv) * 2 * _C * _C
            for e in range(t, _C * _C, THREADS):
                i = e // _C
                j = e % _C
                tmats[_U(base + e)] = buf[tb + i * _PAD + j]
                tmats[_U(base + _C * _C + e)] = buf[i * _PAD + j]
            cuda.syncthreads()

    return kernel


@functools.cache
def _state_kernel(cols: int, threads: int, key_heads: int, key_dim: int):
    """Phase 2 for blocks of `threads` threads owning `cols` value columns (powers of two,
    8 <= cols <= 64, 32 <= threads <= 16 cols) and q, k of `key_heads` heads of
    `key_dim` (flat). Thread t owns columns cg + (cols / 4) q
    (cg = t % (cols / 4), q < 4) of sub-chunk rows r0 + a in the row-side products and of
    state rows rg + row_groups m (rg = t // (cols / 4))."""
    row_len = key_heads * key_dim
    col_groups = cols // 4
    row_groups = threads // col_groups
    tile_loads = _C * _TILE // threads
    tile_row_step = threads // _TILE
    assert cols % 4 == 0 and threads % col_groups == 0 and _C % row_groups == 0 and threads % _TILE == 0
    sub_rows = _C // row_groups
    key_rows = (key_dim + row_groups - 1) // row_groups
    kw = key_dim + 1
    tile_size = max(2 * _TILE_SIZE, _UPDATE_ROWS * kw)
    yw = cols + 1
    state_size = row_groups * key_rows * cols
    y_size = _C * yw
    key_loads = (key_dim + threads - 1) // threads
    ragged_loads = key_dim % threads != 0
    ragged_rows = key_dim % row_groups != 0
    capped = not IS_SIMULATOR and threads == THREADS and cols <= 16 and key_dim <= 128
    options = {"max_registers": _STATE_MAX_REGISTERS} if capped else {}

    @fast
    @cuda.jit(**options)
    def kernel(qn, kn, mixed, v0, beta, off, slot, tmats, din, dout, states, out):
        # qn, kn: flat [rows, key_heads, key_dim] f32; mixed: [rows, channels] f32 (v at column v0)
        # beta, din, dout: [rows, value_heads] f32; tmats: flat [subchunks, value_heads, 2, C, C]
        # states: [slots, value_heads, key_dim, value_dim] f32; out: [rows, value_heads, value_dim] f32
        col0 = cuda.blockIdx.x * cols
        hv = cuda.blockIdx.y
        t = cuda.threadIdx.x
        rows = beta.shape[0]
        value_heads = states.shape[1]
        value_dim = states.shape[3]
        kh = hv // (value_heads // key_heads)
        vcol = v0 + hv * value_dim + col0
        cg = t % col_groups
        rg = t // col_groups
        r0 = rg * sub_rows
        ucg = _U(cg)
        urg = _U(rg)
        urow = _U(r0 * _TW)
        sd = t % _TILE
        si = t // _TILE
        ssh = cuda.shared.array(state_size, np.float32)  # [key rows, cols]: S at the sub-chunk start
        tile = cuda.shared.array(tile_size, np.float32)  # [C, _TW] k | q, T | M T; [_UPDATE_ROWS, kw] k
        ybuf = cuda.shared.array(y_size, np.float32)  # [C, yw]: Y, then v' exp(c_last - c)
        vin = cuda.shared.array(_C, np.float32)
        vout = cuda.shared.array(_C, np.float32)
        vbeta = cuda.shared.array(_C, np.float32)
        sreg = cuda.local.array((key_rows, 4), np.float32)
        left = cuda.local.array((sub_rows, 4), np.float32)  # k.S, then v'
        right = cuda.local.array((sub_rows, 4), np.float32)  # q.S, then o
        vec = cuda.local.array(4, np.float32)
        for m in range(key_rows):
            k = rg + row_groups * m
            for q in range(4):
                col = col0 + cg + col_groups * q
                live = k < key_dim and col < value_dim
                sreg[m, q] = states[slot, hv, k, col] if live else _F32(0.0)
                ssh[k * cols + cg + col_groups * q] = sreg[m, q]
        for s in range((off + rows + _C - 1) // _C):
            lo = max(0, s * _C - off)
            n = min(rows, (s + 1) * _C - off) - lo
            if t < _C:
                vin[t] = din[lo + t, hv] if t < n else _F32(0.0)
                vout[t] = dout[lo + t, hv] if t < n else _F32(0.0)
                vbeta[t] = beta[lo + t, hv] if t < n else _F32(0.0)
            for a in range(sub_rows):
                for q in range(4):
                    left[a, q] = _F32(0.0)
                    right[a, q] = _F32(0.0)
            for k0 in range(0, key_dim, _TILE):  # k.S and q.S over the incoming state
                width = min(_TILE, key_dim - k0)
                src = _U(lo * row_len + kh * key_dim + k0 + min(sd, width - 1))
                for r in range(tile_loads):  # rows past n, dims past width: copies, never used
                    i = si + tile_row_step * r
                    at = src + _U(min(i, n - 1) * row_len)
                    dst = _U(i * _TW + sd)
                    tile[dst] = kn[at]
                    tile[dst + _U(_TILE_SIZE)] = qn[at]
                cuda.syncthreads()
                d = 0
                while d < width:
                    srow = _U((k0 + d) * cols) + ucg
                    trow = urow + _U(d)
                    for q in range(4):
                        vec[q] = ssh[srow + _U(col_groups * q)]
                    for a in range(sub_rows):
                        kv = tile[trow + _U(a * _TW)]
                        qv = tile[trow + _U(_TILE_SIZE + a * _TW)]
                        for q in range(4):
                            left[a, q] += kv * vec[q]
                            right[a, q] += qv * vec[q]
                    d += 1
                cuda.syncthreads()
            for a in range(sub_rows):  # Y = beta (v - exp(c) k.S)
                i = r0 + a
                for q in range(4):
                    col = cg + col_groups * q
                    y = _F32(0.0)
                    if i < n and col0 + col < value_dim:
                        y = vbeta[i] * (mixed[lo + i, vcol + col] - vin[i] * left[a, q])
                    ybuf[i * yw + col] = y
                    left[a, q] = _F32(0.0)
                    right[a, q] = vin[i] * right[a, q]
            for j0 in range(0, n, _TILE):  # v' = T Y, o = exp(c) q.S + (M T) Y
                src = _U((s * value_heads + hv) * 2 * _C * _C + si * _C + j0 + sd)
                for r in range(tile_loads):
                    dst = _U((si + tile_row_step * r) * _TW + sd)
                    tile[dst] = tmats[src + _U(tile_row_step * r * _C)]
                    tile[dst + _U(_TILE_SIZE)] = tmats[src + _U(_C * _C + tile_row_step * r * _C)]
                cuda.syncthreads()
                d = 0
                while d < min(_TILE, r0 + sub_rows - j0):
                    yrow = _U((j0 + d) * yw) + ucg
                    trow = urow + _U(d)
                    for q in range(4):
                        vec[q] = ybuf[yrow + _U(col_groups * q)]
                    for a in range(sub_rows):
                        tv = tile[trow + _U(a * _TW)]
                        mv = tile[trow + _U(_TILE_SIZE + a * _TW)]
                        for q in range(4):
                            left[a, q] += tv * vec[q]
                            right[a, q] += mv * vec[q]
                    d += 1
                cuda.syncthreads()
            for a in range(sub_rows):
                i = r0 + a
                for q in range(4):
                    col = cg + col_groups * q
                    if i < n and col0 + col < value_dim:
                        out[lo + i, hv, col0 + col] = right[a, q]
                    ybuf[i * yw + col] = left[a, q] * vout[i]
            decay = vin[n - 1]
            cuda.syncthreads()
            for m in range(key_rows):  # S = exp(c_last) S + (k exp(c_last - c))^T v'
                for q in range(4):
                    sreg[m, q] *= decay
            for i0 in range(0, n, _UPDATE_ROWS):
                src = _U(lo * row_len + kh * key_dim + t)
                for i in range(_UPDATE_ROWS):  # rows past n: copies, never read
                    at = src + _U(min(i0 + i, n - 1) * row_len)
                    for c in range(key_loads):
                        if not ragged_loads or t + threads * c < key_dim:
                            tile[_U(i * kw + threads * c + t)] = kn[at + _U(threads * c)]
                cuda.syncthreads()
                i = 0
                while i < min(_UPDATE_ROWS, n - i0):
                    yrow = _U((i0 + i) * yw) + ucg
                    krow = _U(i * kw) + urg
                    for q in range(4):
                        vec[q] = ybuf[yrow + _U(col_groups * q)]
                    for m in range(key_rows):
                        if not ragged_rows or rg + row_groups * m < key_dim:
                            kv = tile[krow + _U(row_groups * m)]
                            for q in range(4):
                                sreg[m, q] += kv * vec[q]
                    i += 1
                cuda.syncthreads()
            for m in range(key_rows):
                for q in range(4):
                    ssh[(rg + row_groups * m) * cols + cg + col_groups * q] = sreg[m, q]
        for m in range(key_rows):
            k = rg + row_groups * m
            for q in range(4):
                col = col0 + cg + col_groups * q
                if k < key_dim and col < value_dim:
                    states[slot, hv, k, col] = sreg[m, q]

    return kernel


def _subchunk_offset(start_row: int) -> int:
    """Rows between the last absolute multiple of SUBCHUNK_ROWS and the chunk's start."""
    return start_row % SUBCHUNK_ROWS


def check_chunk_args(qn, kn, mixed, v0: int, g, beta, start_row: int, slot: int, states) -> tuple[int, ...]:
    """What the prefill delta rules (this one and delta_mma.delta_mma) require of their common
    arguments (see `delta_chunked`): dtypes and ranks, q / k / state head shapes that fit, v
    inside `mixed`, gates of [rows, value_heads], slot and start_row in range. Returns (rows,
    key_heads, key_dim, value_heads, value_dim). Raises ValueError naming the argument."""
    check("qn", qn, np.float32, 3)
    check("kn", kn, np.float32, 3)
    check("mixed", mixed, np.float32, 2)
    check("g", g, np.float32, 2)
    check("beta", beta, np.float32, 2)
    check("states", states, np.float32, 4)
    rows, key_heads, key_dim = qn.shape
    slots, value_heads, _, value_dim = states.shape
    if tuple(kn.shape) != tuple(qn.shape) or states.shape[2] != key_dim or value_heads % key_heads:
        raise ValueError(f"qn {qn.shape} / kn {kn.shape} do not fit states {states.shape}")
    if mixed.shape[0] != rows or v0 < 0 or mixed.shape[1] < v0 + value_heads * value_dim:
        raise ValueError(f"mixed {mixed.shape} does not hold v at column {v0} for states {states.shape}")
    if tuple(g.shape) != (rows, value_heads) or tuple(beta.shape) != (rows, value_heads):
        raise ValueError(f"g {g.shape} / beta {beta.shape} do not fit {rows} rows of {value_heads} value heads")
    if not 0 <= slot < slots or start_row < 0:
        raise ValueError(f"slot {slot} of {slots} / start_row {start_row} out of range")
    return rows, key_heads, key_dim, value_heads, value_dim


def delta_chunked(qn, kn, mixed, v0: int, g, beta, start_row: int, slot: int, states, out=None, stream=0):
    """Run the gated delta rule over one stream's prefill chunk, advancing its state in place.

    qn, kn: f32 device [rows, key_heads, key_dim], contiguous (`conv.causal_conv1d_qkv`: qn already
    scaled by key_dim**-0.5); mixed: f32 [rows, channels] holding v at columns
    [v0, v0 + value_heads * value_dim); g, beta: f32 [rows, value_heads] (value head h reads
    key head h // (value_heads // key_heads)); the rows are the absolute rows
    [start_row, start_row + rows) of the stream whose state is states[slot], states: f32
    [slots, value_heads, key_dim, value_dim] (one layer). Returns f32 [rows, value_heads,
    value_dim]. Raises ValueError when shapes do not fit (key_dim > 256, value_heads not a
    multiple of key_heads, qn / kn not contiguous) or slot / start_row is out of range.
    Decode (one row per lane) stays with `delta_recurrence`.

    Exactness: sub-chunks of SUBCHUNK_ROWS rows anchored at absolute multiples (a chunk
    from row 100 runs [100, 128), [128, 192), ...), each computed from its own rows and the
    incoming fp32 state with fixed reduction orders, the state carried between them in
    fp32 exactly as between chunks: a row's output and the state at a multiple of 64 have
    the same bits for every chunking whose cuts are multiples of 64.

    Two launches on `stream`:
    phase 1 (`_subchunk_kernel`), grid (sub-chunks, value_heads), THREADS threads, 33.8 KB
    static shared: the Gram matrices k.k and q.k of the sub-chunk's key head, then for its
    value head c = cumsum(g), A = strict_lower(beta_i k_i.k_j
    exp(c_i - c_j)), T = (I + A)^-1 by forward substitution (one column per thread) and
    M T with M = lower_incl(q_i.k_j exp(c_i - c_j)), into scratch (2 x 64 x 64 f32 per
    sub-chunk and value head: 201 MB at 48 value heads x 8192 rows), with exp(c) and
    exp(c_last - c) per row;
    phase 2 (`_state_kernel`), grid (value_dim / STATE_COLS, value_heads), STATE_THREADS
    threads, 30 KB static shared at key_dim 128: walks the chunk's sub-chunks with its
    STATE_COLS state columns in registers: Y = beta (v - exp(c) k.S), v' = T Y (= u - w S),
    o = exp(c) q.S + (M T) Y, S = exp(c_last) S + (k exp(c_last - c))^T v'.
    Source: the UT transform of DeltaNet, as in FLA chunk_gated_delta_rule. Twin:
    ops.gated_delta_rule_chunked (float64 inside a sub-chunk; fp32 here agrees to ~1e-6).
    """
    rows, key_heads, key_dim, value_heads, value_dim = check_chunk_args(qn, kn, mixed, v0, g, beta, start_row, slot,
                                                                       states)
    if key_dim > MAX_KEY_DIM:
        raise ValueError(f"key_dim {key_dim} is over {MAX_KEY_DIM}")
    if tuple(qn.strides) != tuple(kn.strides) or tuple(qn.strides)[:2] != (4 * key_heads * key_dim, 4 * key_dim):
        raise ValueError(f"qn / kn must be contiguous, strides {qn.strides} / {kn.strides}")
    out = empty((rows, value_heads, value_dim), np.float32, stream) if out is None else out
    if not rows:
        return out
    off = _subchunk_offset(start_row)
    subchunks = (off + rows + SUBCHUNK_ROWS - 1) // SUBCHUNK_ROWS
    tmats = empty(subchunks * value_heads * 2 * SUBCHUNK_ROWS * SUBCHUNK_ROWS, np.float32, stream)
    din = empty((rows, value_heads), np.float32, stream)
    dout = empty((rows, value_heads), np.float32, stream)
    q_flat, k_flat = qn.reshape(qn.size), kn.reshape(kn.size)
    group = value_heads // key_heads
    per_block = PHASE1_VALUE_HEADS if PHASE1_VALUE_HEADS and group % PHASE1_VALUE_HEADS == 0 else group
    phase1 = _subchunk_kernel(key_heads, key_dim, per_block)
    phase1[(subchunks, value_heads // per_block), THREADS, stream](q_flat, k_flat, g, beta, off, tmats, din, dout)
    phase2 = _state_kernel(STATE_COLS, STATE_THREADS, key_heads, key_dim)
    grid = ((value_dim + STATE_COLS - 1) // STATE_COLS, value_heads)
    phase2[grid, STATE_THREADS, stream](q_flat, k_flat, mixed, v0, beta, off, slot, tmats, din, dout, states, out)
    return out
