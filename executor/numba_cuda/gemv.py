"""Row-invariant bf16 GEMV-style product for few rows (decode lanes, the LM head row).

out[r, n] = sum_k x[r, k] * w[n, k] with bf16 inputs and fp32 accumulation. Each row is
reduced in the same fixed order whatever the number of rows (one block per output column
and group of up to 16 rows; per-thread partial sums over a strided k range, then a fixed
shared-memory tree), so a lane's bits do not depend on the other lanes. Twin: ops.linear.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from executor.numba_cuda.device import THREADS, bf16_to_f32, check, empty

GROUP_ROWS = 16
"""Rows sharing one pass over the weights; larger row counts run in groups of this."""

_F32 = np.float32
_MASK = np.uint64(0xFFFF)


@cuda.jit(device=True, inline=True)
def _dot4(w, x):
    """Sum of the products of the four bf16 pairs packed in two uint64 words."""
    s = bf16_to_f32(w & _MASK) * bf16_to_f32(x & _MASK)
    s += bf16_to_f32((w >> np.uint64(16)) & _MASK) * bf16_to_f32((x >> np.uint64(16)) & _MASK)
    s += bf16_to_f32((w >> np.uint64(32)) & _MASK) * bf16_to_f32((x >> np.uint64(32)) & _MASK)
    s += bf16_to_f32((w >> np.uint64(48)) & _MASK) * bf16_to_f32((x >> np.uint64(48)) & _MASK)
    return s


@cuda.jit
def _gemv_kernel(x4, w4, out):
    # x4: [rows, K / 4] u64 (bf16 quads); w4: [N, K / 4] u64; out: [rows, N] f32
    n = cuda.blockIdx.x
    r0 = cuda.blockIdx.y * GROUP_ROWS
    t = cuda.threadIdx.x
    nr = min(GROUP_ROWS, x4.shape[0] - r0)
    words = w4.shape[1]
    acc = cuda.local.array(GROUP_ROWS, np.float32)
    for r in range(GROUP_ROWS):
        acc[r] = _F32(0.0)
    for j in range(t, words, THREADS):
        w = w4[n, j]
        for r in range(GROUP_ROWS):
            if r < nr:
                acc[r] += _dot4(w, x4[r0 + r, j])
    buf = cuda.shared.array((GROUP_ROWS, THREADS), np.float32)
    for r in range(GROUP_ROWS):
        buf[r, t] = acc[r]
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            for r in range(GROUP_ROWS):
                buf[r, t] += buf[r, t + step]
        cuda.syncthreads()
        step //= 2
    if t < nr:
        out[r0 + t, n] = buf[t, 0]


def gemv(x, weight, out=None, stream=0):
    """out = float32(x @ weight.T), each row reduced in a row-count-independent order.

    x: uint16 (bf16) device [rows, K], contiguous; weight: uint16 (bf16) [N, K],
    contiguous; K % 4 == 0. Returns f32 [rows, N]. Twin: ops.linear on the float32 values.
    """
    check("x", x, np.uint16, 2)
    check("weight", weight, np.uint16, 2)
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has {k}")
    if k % 4:
        raise ValueError(f"K = {k} must be a multiple of 4")
    if not (x.is_c_contiguous() and weight.is_c_contiguous()):
        raise ValueError("x and weight must be C-contiguous")
    out = empty((rows, n), np.float32, stream) if out is None else out
    if rows:
        x4 = x.view(np.uint64)
        w4 = weight.view(np.uint64)
        grid = (n, (rows + GROUP_ROWS - 1) // GROUP_ROWS)
        _gemv_kernel[grid, THREADS, stream](x4, w4, out)
    return out
