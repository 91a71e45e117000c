"""Causal depthwise conv1d + SiLU of the linear attention, over prefill rows or one decode
row per lane, from and into each stream's carried conv tail; with `causal_conv1d_qkv`, the
q and k channels come out L2-normalised per head (q also times key_dim^-0.5), in the same
pass.

The conv input is rounded to bf16 on read (the tail is stored in bf16, DESIGN state
bytes), so a row's bits are the same whether its predecessors came from this chunk or
from the tail: conv is chunk-invariant at every cut. Two launches: the conv, one thread
per (tile of ROW_TILE rows, channel) (per (row, channel) in decode), each row finding its
lane in row_start; then the tail update, one thread per (lane, channel), queued after it
on the same stream so the conv reads the old tails. Twins: ops.causal_conv1d,
ops.l2_normalize.

A conv thread loads its tile's inputs (ROW_TILE + taps - 1 rows) before it computes any:
a thread that loaded a row, used it and then loaded the next had one load in flight and ran
the conv at ~1.5 TB/s on the H200 (bench/RESULTS.md, session 28). The conv then counted its
instructions, not its bytes: a tile whose rows and the taps - 1 rows before them are all one
lane's (most tiles of a long chunk) sums from the loaded rows alone, without the per-tap tail
test and lane walk (the same fma chain, exp and division a value: the PTX's float
instructions a value are identical on both paths), and indices are unsigned (no negative-index
wraparound code: 64-bit integer instructions were half the kernel's). Still instruction-bound
at the 9B's 8K chunk on the H100 (Nsight Compute, session 37: DRAM 61%, issue slots 76% busy,
~94 instructions an output), so: the bf16 rounding of an input is 32-bit arithmetic
(device.round_bf16, same bits; numba's uint32 sums were 64-bit), a tile's loads and stores
step a row pointer (row r0 + i as u32(r0) + i, which LLVM folds, not u32(r0 + i), which it
must truncate a row at a time; a q/k head stored through its [rows, key_dim] view), and a q/k
tile's norms take one reduce-scatter butterfly for all its rows (norms.warp_sum_rows) and one
square root and division a lane instead of a butterfly, a root and a division a row in every
thread (each row's inverse norm is then shuffled from the lanes that hold it): 48 -> 44
registers, same float operations a value (PTX and ptxas for sm_90), and the 9B's 32K prefill's
conv time 27.1 -> 22.2 ms on the H100 with the same logits bits (bench/RESULTS.md, session
37). The L2 norm of a q or k
head (key_dim channels) is summed in the order `delta_rule`'s separate prep kernel used
before this pass existed: thread t adds its channels t, t + THREADS, ... to 0, then a
fixed tree over the block's THREADS slots (its last five steps as a warp's xor butterfly,
which pairs the same values), so the bits did not change when the two fused.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import (
    THREADS,
    bf16_to_f32,
    blocks,
    check,
    empty,
    f32_to_bf16,
    round_bf16,
)
from executor.numba_cuda.launch import fast
from executor.numba_cuda.norms import fold_wide, shfl_idx, warp_sum, warp_sum_rows

ROW_TILE = 8
"""Consecutive rows of one channel each conv thread computes in prefill (1 in decode). Knob:
more rows share a thread's lane search, weights and taps - 1 halo loads (11 loads for 8 rows at
4 taps) and, at a power of two up to 32, one norm per lane group (`_conv_kernel_for`), for more
registers held across the tile's loads; no bit depends on it. 8: 48 registers, 62.5% occupancy
on the H100 before session 37 (Nsight Compute), 44 since (ptxas for sm_90, same occupancy).
H100, 9B, 32K rows, before session 37: 8 1.057 ms, 4 1.237, 16 1.241 (bench/RESULTS.md)."""
MAX_KEY_DIM = 2 * THREADS
"""Largest key head dim `causal_conv1d_qkv` normalises (a thread takes at most two channels);
the delta-rule kernels take at most the same (delta_rule.MAX_KEY_DIM)."""
_F32 = np.float32
_WARPS = THREADS // 32


@cuda.jit(device=True, inline=True)
def _same(v):
    return v


@functools.cache
def _conv_kernel_for(taps: int, key_dim: int, row_tile: int, bf16_in: bool = False):
    """The conv kernel for `taps` taps (the model's conv kernel size), q/k heads of `key_dim`
    channels (0: no normalised heads) and `row_tile` rows a thread; x f32 (rounded to bf16 as
    it is loaded) or, with `bf16_in`, uint16 bf16 bits (in_proj's product from cuBLASLt's bf16
    epilogue: the values the f32 path rounds to, so the same bits). Block y < 2 * key_heads
    is one q (then k) head: its conv outputs L2-normalised over the head; the other blocks
    are THREADS plain channels each, from channel 2 * key_heads * key_dim on. Grid: (row
    tiles, channel blocks), row tiles fastest (channel blocks fastest ran 1.4x slower at the
    9B's 32K chunk, bench/RESULTS.md session 28)."""
    keep = taps - 1
    span = row_tile + keep
    per = max(1, -(-key_dim // THREADS))  # channels of a q/k head one thread takes
    # rows a power of two up to 32: the q/k norm's last five tree steps for all the tile's rows
    # at once (norms.warp_sum_rows), lane l holding row l >> shift; else a warp_sum a row
    scatter = 1 < row_tile <= 32 and row_tile & (row_tile - 1) == 0
    shift = 5 - (row_tile.bit_length() - 1)
    load = bf16_to_f32 if bf16_in else _same  # x's element as f32 ..
    rounded = _same if bf16_in else round_bf16  # .. then as bf16 (an f32 x only)

    @cuda.jit(device=True, inline=True)
    def conv_tile(x, row_start, slots, weight, tails, r0, end, c, y, k):
        # y[k, i] = silu(sum_j weight[c, j] * input(row r0 + i, tap j)) for the tile's rows
        # (0 past `end`); input: concat(lane's tail, bf16(lane's rows of x)) at r - row0 + j
        lanes = slots.shape[0]
        lane = 0
        hi = lanes  # row_start[lane] <= r0 < row_start[hi]
        while hi - lane > 1:
            mid = (lane + hi) // 2
            if row_start[u32(mid)] <= r0:
                lane = mid
            else:
                hi = mid
        row0 = row_start[u32(lane)]
        nxt = row_start[u32(lane + 1)]
        slot = slots[u32(lane)]
        w = cuda.local.array(taps, np.float32)
        xin = cuda.local.array(span, np.float32)  # x of rows r0 - keep .., then as bf16
        cu = u32(c)
        for j in range(taps):
            w[j] = weight[cu, u32(j)]
        # inside: the tile's rows and the keep rows before them are all this lane's (no tail, no
        # lane change, no row past the call's end): most tiles of a long chunk
        inside = r0 - keep >= row0 and r0 + row_tile <= nxt
        if inside:
            first = u32(r0 - keep)  # >= row0 >= 0; first + m has no wraparound for LLVM to keep
            for m in range(span):  # every load issued before any is used
                xin[m] = load(x[first + u32(m), cu])
        else:
            for m in range(span):  # rows clamped into the call's
                xin[m] = load(x[u32(min(max(r0 - keep + m, 0), end - 1)), cu])
        for m in range(span):
            xin[m] = rounded(xin[m])  # bf16_to_f32(f32_to_bf16(.)), in 32-bit arithmetic
        if inside:  # the same sums as below, from xin only
            for i in range(row_tile):
                acc = _F32(0.0)
                for j in range(taps):
                    acc += w[j] * xin[i + j]
                y[k, i] = acc / (_F32(1.0) + math.exp(-acc))
            return
        for i in range(row_tile):
            r = r0 + i
            y[k, i] = _F32(0.0)
            if r < end:
                while r >= nxt:  # a new lane starts inside the tile (empty lanes skipped)
                    lane += 1
                    row0 = nxt
                    nxt = row_start[u32(lane + 1)]
                    slot = slots[u32(lane)]
                acc = _F32(0.0)
                for j in range(taps):
                    q = r - row0 + j  # position in concat(tail, the lane's rows)
                    v = bf16_to_f32(tails[u32(slot), u32(q), cu]) if q < keep else xin[i + j]
                    acc += w[j] * v
                y[k, i] = acc / (_F32(1.0) + math.exp(-acc))

    @fast
    @cuda.jit
    def _conv_kernel(x, row_start, slots, weight, tails, key_heads, qn, kn, out):
        # x: [rows, channels] f32 or bf16 (may be a column slice); row_start: [lanes + 1] i32
        # slots: [lanes] i32; weight: [channels, taps] f32; tails: [slots, taps - 1, channels] bf16
        # qn, kn: [rows, key_heads, key_dim] f32; out: [rows, channels - 2 key_heads key_dim] f32
        t = cuda.threadIdx.x
        yb = cuda.blockIdx.y
        r0 = cuda.blockIdx.x * row_tile
        ur0 = u32(r0)  # row ur0 + u32(i): one base, no per-row truncation for LLVM to keep
        end = row_start[slots.shape[0]]
        if r0 >= end:  # the whole block
            return
        y = cuda.local.array((per, row_tile), np.float32)
        if yb >= 2 * key_heads:  # plain channels
            c = 2 * key_heads * key_dim + (yb - 2 * key_heads) * THREADS + t
            if c >= x.shape[1]:
                return
            conv_tile(x, row_start, slots, weight, tails, r0, end, c, y, 0)
            oc = u32(c - 2 * key_heads * key_dim)
            for i in range(row_tile):
                if r0 + i < end:
                    out[ur0 + u32(i), oc] = y[0, i]
            return
        # head yb (q heads, then k heads): its key_dim channels, thread t taking t, t + THREADS, ...
        for k in range(per):
            ch = t + k * THREADS
            if ch < key_dim:
                conv_tile(x, row_start, slots, weight, tails, r0, end, yb * key_dim + ch, y, k)
            else:
                for i in range(row_tile):
                    y[k, i] = _F32(0.0)
        buf = cuda.shared.array((row_tile, THREADS), np.float32)
        for i in range(row_tile):
            sq = _F32(0.0)
            for k in range(per):
                sq += y[k, i] * y[k, i]
            buf[i, t] = sq
        cuda.syncthreads()
        fold_wide(buf, 0, row_tile)
        scale = _F32(1.0) / math.sqrt(_F32(key_dim))
        is_q = yb < key_heads
        head = yb if is_q else yb - key_heads
        # the head's [rows, key_dim] views: a row's address is one add from the last (indexing
        # qn[r, head, ch] multiplied out ((r * heads + head) * key_dim + ch) at every row)
        q_head = qn[:, u32(head) if is_q else u32(0)]
        k_head = kn[:, u32(0) if is_q else u32(head)]
        scratch = cuda.shared.array((_WARPS, 32), np.float32)  # the simulator's warp tree only
        if scatter:  # each row's sum in one lane group, its norm there, then shuffled to all
            lane = u32(t) % u32(32)
            v = cuda.local.array(row_tile, np.float32)
            for i in range(row_tile):
                v[i] = buf[u32(i), lane]
            mine = _F32(1.0) / math.sqrt(warp_sum_rows(v, row_tile, scratch) + _F32(1e-6))
        for i in range(row_tile):
            if scatter:
                inv = shfl_idx(mine, i << shift, scratch)
            else:
                total = warp_sum(buf[i, t % 32], scratch)
                inv = _F32(1.0) / math.sqrt(total + _F32(1e-6))
            r = r0 + i
            if r < end:
                for k in range(per):
                    ch = t + k * THREADS
                    if ch < key_dim:
                        if is_q:
                            q_head[ur0 + u32(i), u32(ch)] = (y[k, i] * inv) * scale
                        else:
                            k_head[ur0 + u32(i), u32(ch)] = y[k, i] * inv

    return _conv_kernel


@functools.cache
def _tail_kernel_for(bf16_in: bool):
    """The tail update for an f32 x (rounded to bf16 here) or, with `bf16_in`, a bf16 one."""
    to_bf16 = _same if bf16_in else f32_to_bf16

    @fast
    @cuda.jit
    def _tail_kernel(x, row_start, slots, tails):
        # x: [rows, channels] f32 or bf16; row_start: [lanes + 1] i32; slots: [lanes] i32
        # tails: [slots, kernel - 1, channels] bf16 -> the last kernel - 1 rows of concat(tail, bf16(x))
        c = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        lane = cuda.blockIdx.y
        if c >= x.shape[1]:
            return
        slot = slots[lane]
        row0 = row_start[lane]
        rows = row_start[lane + 1] - row0
        keep = tails.shape[1]
        for i in range(keep):
            p = rows + i
            if p < keep:
                tails[slot, i, c] = tails[slot, p, c]
            else:
                tails[slot, i, c] = to_bf16(x[row0 + p - keep, c])

    return _tail_kernel


def _check(x, row_start, slots, weight, tails) -> None:
    check("x", x, np.uint16 if getattr(x, "dtype", None) == np.uint16 else np.float32, 2)
    check("weight", weight, np.float32, 2)
    check("tails", tails, np.uint16, 3)
    channels = x.shape[1]
    if weight.shape[0] != channels or tuple(tails.shape)[1:] != (weight.shape[1] - 1, channels):
        raise ValueError(f"weight {weight.shape} / tails {tails.shape} do not fit x {x.shape}")
    if row_start.shape[0] != slots.shape[0] + 1:
        raise ValueError(f"row_start has {row_start.shape[0]} entries for {slots.shape[0]} lanes")


def _launch(x, row_start, slots, weight, tails, key_heads, key_dim, qn, kn, out, stream) -> None:
    """The conv (and norm) launch, then the tail update, on `stream`."""
    rows, channels = x.shape
    lanes = slots.shape[0]
    if not (rows and lanes):
        return
    row_tile = 1 if rows <= lanes else ROW_TILE
    plain = channels - 2 * key_heads * key_dim
    grid = (blocks(rows, row_tile), 2 * key_heads + (blocks(plain) if plain else 0))
    bf16_in = x.dtype == np.uint16
    _conv_kernel_for(weight.shape[1], key_dim, row_tile, bf16_in)[grid, THREADS, stream](
        x, row_start, slots, weight, tails, key_heads, qn, kn, out)
    _tail_kernel_for(bf16_in)[(blocks(channels), lanes), THREADS, stream](x, row_start, slots, tails)


def causal_conv1d(x, row_start, slots, weight, tails, out=None, stream=0):
    """out = silu(causal depthwise conv of concat(tail, bf16(x))) per lane; tails advance.

    x: f32 device [rows, channels] or uint16 bf16 bits (as the backend's long prefill chunks
    take in_proj; the same outputs as from the f32 values they round), the rows of all lanes
    (lane l owning rows [row_start[l], row_start[l + 1])); row_start: i32 [lanes + 1]; slots: i32 [lanes]
    (each lane's stream slot, distinct); weight: f32 [channels, kernel];
    tails: uint16 (bf16) [slots, kernel - 1, channels] (one layer, updated in place).
    Returns f32 [rows, channels]. Each output is sum_j weight[c, j] * bf16(input) over
    j = 0..kernel-1 in order, then SiLU, whatever tile or chunk the row sits in.
    Raises ValueError when weight, tails or row_start do not fit x.
    Twin: ops.causal_conv1d (tail and x rounded to bf16).
    """
    _check(x, row_start, slots, weight, tails)
    out = empty(tuple(x.shape), np.float32, stream) if out is None else out
    none = empty((0, 0, 0), np.float32, stream)
    _launch(x, row_start, slots, weight, tails, 0, 0, none, none, out, stream)
    return out


def causal_conv1d_qkv(x, row_start, slots, weight, tails, key_heads: int, key_dim: int, stream=0):
    """The linear attention's conv over [q | k | v] channels, q and k L2-normalised per head.

    x, row_start, slots, weight, tails: as `causal_conv1d`, x's first 2 * key_heads *
    key_dim channels q's heads then k's. Returns (qn, kn, v): qn = l2norm(conv q) *
    key_dim^-0.5 and kn = l2norm(conv k), f32 [rows, key_heads, key_dim] (norm: x / sqrt(sum
    x^2 + 1e-6), the sum in a fixed order that depends on no row count); v = the conv of the
    other channels, f32 [rows, channels - 2 * key_heads * key_dim]. Every value is
    `causal_conv1d`'s then the norm; the bits are those of the separate conv and prep
    kernels this pass replaced (shown on the H200 at key_dim 128, every Qwen3.5 shape,
    bench/RESULTS.md session 28; under the simulator at any key_dim). Raises ValueError when
    the arrays do not fit, key_heads < 1, q and k need more than x's channels, or key_dim is
    not in 1..MAX_KEY_DIM. Twins: ops.causal_conv1d, ops.l2_normalize
    (Qwen3_5GatedDeltaNet's use_qk_l2norm_in_kernel, eps 1e-6).
    """
    _check(x, row_start, slots, weight, tails)
    if not 0 < key_dim <= MAX_KEY_DIM:
        raise ValueError(f"key_dim must be in 1..{MAX_KEY_DIM}, got {key_dim}")
    rows, channels = x.shape
    if key_heads < 1 or 2 * key_heads * key_dim > channels:
        raise ValueError(f"{key_heads} q and k heads of {key_dim} do not fit x's {channels} channels")
    qn = empty((rows, key_heads, key_dim), np.float32, stream)
    kn = empty((rows, key_heads, key_dim), np.float32, stream)
    v = empty((rows, channels - 2 * key_heads * key_dim), np.float32, stream)
    _launch(x, row_start, slots, weight, tails, key_heads, key_dim, qn, kn, v, stream)
    return qn, kn, v
