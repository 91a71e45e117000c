"""The greedy pick on the device: each logits row's argmax, so that a greedy lane's token
needs no host pass over the vocabulary.

On the H200 server the host's `np.argmax` over one 248,320-entry row took 0.1-0.3 ms in
decode rounds and 0.5-1.1 ms for a request's first token (against 22 us in a quiet process
on the same machine: bench/RESULTS.md, session 21), all of it on the way to the client. The
row is on the device already; a pass over it there is a few microseconds and the host reads
back 4 bytes a lane. The logits still come back whole (kept states and sampling that is not
greedy read them).

Twin: `np.argmax` over each row, bit for bit: the first index of the largest value, where
NaN counts as larger than any number (numpy returns the first NaN) and -0.0 equals +0.0.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import IS_SIMULATOR, check, empty
from executor.numba_cuda.launch import fast

ARGMAX_THREADS = 32 if IS_SIMULATOR else 1024
"""Threads per row (a power of two): each scans a strided share of the row, then a tree in
shared memory; the pick does not depend on it (fewer under the simulator, which runs a
Python thread per CUDA thread)."""


@cuda.jit(device=True, inline=True)
def _better(v, i, w, j):
    # whether (v, i) comes before (w, j) in np.argmax's order: NaN first, then larger, then lower index
    vn, wn = math.isnan(v), math.isnan(w)
    if vn != wn:
        return vn
    if vn or v == w:
        return i < j
    return v > w


@fast
@cuda.jit
def _argmax_kernel(logits, out):
    # logits: [rows, vocab] f32; out: [rows] i32; one block a row
    row = u32(cuda.blockIdx.x)  # unsigned indices (all >= 0): no negative-index wraparound code
    t = cuda.threadIdx.x
    ut = u32(t)
    n = logits.shape[1]
    vals = cuda.shared.array(ARGMAX_THREADS, np.float32)
    idxs = cuda.shared.array(ARGMAX_THREADS, np.int32)
    best_v = np.float32(-math.inf)
    best_i = np.int32(n)  # past the row: any element beats it (a -inf row keeps index 0, below)
    k = t
    while k < n:
        v = logits[row, u32(k)]
        if best_i == n or _better(v, k, best_v, best_i):
            best_v = v
            best_i = k
        k += ARGMAX_THREADS
    vals[ut] = best_v
    idxs[ut] = best_i
    cuda.syncthreads()
    half = ARGMAX_THREADS // 2
    while half > 0:
        if t < half:
            j = idxs[u32(t + half)]
            if j < n and (idxs[ut] == n or _better(vals[u32(t + half)], j, vals[ut], idxs[ut])):
                vals[ut] = vals[u32(t + half)]
                idxs[ut] = j
        cuda.syncthreads()
        half //= 2
    if t == 0:
        out[row] = idxs[0]


def argmax_rows(logits, out=None, stream=0):
    """Each row's argmax as np.argmax gives it (see the module docstring).

    logits: f32 device [rows, vocab], vocab >= 1; out: i32 device [rows] or None (a new
    array from the device pool); returns out. Raises ValueError naming the argument on a
    wrong dtype, rank or shape."""
    check("logits", logits, np.float32, 2)
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column")
    if out is None:
        out = empty((rows,), np.int32, stream)
    else:
        check("out", out, np.int32, 1)
        if out.shape[0] != rows:
            raise ValueError(f"out has {out.shape[0]} entries for {rows} rows")
    if rows:
        _argmax_kernel[rows, ARGMAX_THREADS, stream](logits, out)
    return out
