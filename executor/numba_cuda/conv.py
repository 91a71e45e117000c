"""Causal depthwise conv1d + SiLU of the linear attention, over prefill rows or one decode
row per lane, from and into each stream's carried conv tail.

The conv input is rounded to bf16 on read (the tail is stored in bf16, DESIGN state
bytes), so a row's bits are the same whether its predecessors came from this chunk or
from the tail: conv is chunk-invariant at every cut. Twin: ops.causal_conv1d.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import THREADS, bf16_to_f32, blocks, check, empty, f32_to_bf16

_F32 = np.float32


@cuda.jit
def _conv_kernel(x, row_start, slots, weight, tails, out):
    # x: [rows, channels] f32 (may be a column slice); row_start: [lanes + 1] i32
    # slots: [lanes] i32; weight: [channels, kernel] f32; tails: [slots, kernel - 1, channels] bf16
    c = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    lane = cuda.blockIdx.y
    channels = x.shape[1]
    if c >= channels:
        return
    slot = slots[lane]
    row0 = row_start[lane]
    rows = row_start[lane + 1] - row0
    keep = weight.shape[1] - 1
    for t in range(rows):
        acc = _F32(0.0)
        for j in range(keep + 1):
            p = t + j
            if p < keep:
                v = bf16_to_f32(tails[slot, p, c])
            else:
                v = bf16_to_f32(f32_to_bf16(x[row0 + p - keep, c]))
            acc += weight[c, j] * v
        out[row0 + t, c] = acc / (_F32(1.0) + math.exp(-acc))
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
    Returns f32 [rows, channels]. Twin: ops.causal_conv1d (tail and x rounded to bf16).
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
        _conv_kernel[(blocks(channels), lanes), THREADS, stream](x, row_start, slots, weight, tails, out)
    return out
