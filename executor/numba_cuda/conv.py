"""Causal depthwise conv1d + SiLU of the linear attention, over prefill rows or one decode
row per lane, from and into each stream's carried conv tail.

The conv input is rounded to bf16 on read (the tail is stored in bf16, DESIGN state
bytes), so a row's bits are the same whether its predecessors came from this chunk or
from the tail: conv is chunk-invariant at every cut. Two launches: the conv, one thread
per (tile of ROW_TILE rows, channel) (per (row, channel) in decode), each row finding its
lane in row_start and sliding a window of the kernel's inputs down its rows (one load of x
per row); then the tail update, one thread per (lane, channel), queued after it
on the same stream so the conv reads the old tails. Twin: ops.causal_conv1d.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import (
    THREADS,
    bf16_to_f32,
    blocks,
    check,
    empty,
    f32_to_bf16,
)
from executor.numba_cuda.launch import fast

ROW_TILE = 8
"""Consecutive rows of one channel each conv thread computes in prefill (1 in decode)."""
_F32 = np.float32


@cuda.jit(device=True, inline=True)
def _input(x, tails, slot, row0, q, c, keep):
    """Position q of a lane's conv input concat(tail, bf16(x rows)), as f32."""
    if q < keep:
        return bf16_to_f32(tails[slot, q, c])
    return bf16_to_f32(f32_to_bf16(x[row0 + q - keep, c]))


@functools.cache
def _conv_kernel_for(taps: int):
    """The conv kernel for `taps` taps (the model's conv kernel size): each thread slides a
    window of `taps` inputs down its rows, loading one new input per row."""
    keep = taps - 1

    @fast
    @cuda.jit
    def _conv_kernel(x, row_start, slots, weight, tails, row_tile, out):
        # x: [rows, channels] f32 (may be a column slice); row_start: [lanes + 1] i32
        # slots: [lanes] i32; weight: [channels, taps] f32; tails: [slots, taps - 1, channels] bf16
        # out: [rows, channels] f32; thread (tile, c) computes rows [tile * row_tile, + row_tile) of c
        c = cuda.blockIdx.y * THREADS + cuda.threadIdx.x
        r0 = cuda.blockIdx.x * row_tile
        lanes = slots.shape[0]
        end = row_start[lanes]
        if c >= x.shape[1] or r0 >= end:
            return
        lane = 0
        hi = lanes  # row_start[lane] <= r0 < row_start[hi]
        while hi - lane > 1:
            mid = (lane + hi) // 2
            if row_start[mid] <= r0:
                lane = mid
            else:
                hi = mid
        w = cuda.local.array(taps, np.float32)
        win = cuda.local.array(taps, np.float32)  # inputs of rows r - keep .. r
        for j in range(taps):
            w[j] = weight[c, j]
        slot = slots[lane]
        row0 = row_start[lane]
        for j in range(keep):
            win[j] = _input(x, tails, slot, row0, r0 - row0 + j, c, keep)
        for r in range(r0, min(r0 + row_tile, end)):
            if r >= row_start[lane + 1]:  # a new lane starts inside the tile: refill
                while r >= row_start[lane + 1]:
                    lane += 1
                slot = slots[lane]
                row0 = row_start[lane]
                for j in range(keep):
                    win[j] = _input(x, tails, slot, row0, r - row0 + j, c, keep)
            win[keep] = _input(x, tails, slot, row0, r - row0 + keep, c, keep)
            acc = _F32(0.0)
            for j in range(taps):
                acc += w[j] * win[j]
            out[r, c] = acc / (_F32(1.0) + math.exp(-acc))
            for j in range(keep):
                win[j] = win[j + 1]

    return _conv_kernel


@fast
@cuda.jit
def _tail_kernel(x, row_start, slots, tails):
    # x: [rows, channels] f32; row_start: [lanes + 1] i32; slots: [lanes] i32
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
            tails[slot, i, c] = f32_to_bf16(x[row0 + p - keep, c])


def causal_conv1d(x, row_start, slots, weight, tails, out=None, stream=0):
    """out = silu(causal depthwise conv of concat(tail, bf16(x))) per lane; tails advance.

    x: f32 device [rows, channels] (rows of all lanes, lane l owning rows
    [row_start[l], row_start[l + 1])); row_start: i32 [lanes + 1]; slots: i32 [lanes]
    (each lane's stream slot, distinct); weight: f32 [channels, kernel];
    tails: uint16 (bf16) [slots, kernel - 1, channels] (one layer, updated in place).
    Returns f32 [rows, channels]. Each output is sum_j weight[c, j] * bf16(input) over
    j = 0..kernel-1 in order, then SiLU, whatever tile or chunk the row sits in.
    Raises ValueError when weight, tails or row_start do not fit x.
    Twin: ops.causal_conv1d (tail and x rounded to bf16).
    """
    check("x", x, np.float32, 2)
    check("weight", weight, np.float32, 2)
    check("tails", tails, np.uint16, 3)
    rows, channels = x.shape
    lanes = slots.shape[0]
    if weight.shape[0] != channels or tuple(tails.shape)[1:] != (weight.shape[1] - 1, channels):
        raise ValueError(f"weight {weight.shape} / tails {tails.shape} do not fit x {x.shape}")
    if row_start.shape[0] != lanes + 1:
        raise ValueError(f"row_start has {row_start.shape[0]} entries for {lanes} lanes")
    out = empty((rows, channels), np.float32, stream) if out is None else out
    if rows and lanes:
        row_tile = 1 if rows <= lanes else ROW_TILE
        _conv_kernel_for(weight.shape[1])[(blocks(rows, row_tile), blocks(channels)), THREADS, stream](
            x, row_start, slots, weight, tails, row_tile, out
        )
        _tail_kernel[(blocks(channels), lanes), THREADS, stream](x, row_start, slots, tails)
    return out
