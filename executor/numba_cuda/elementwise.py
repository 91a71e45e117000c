"""Elementwise kernels: the embedding gather, the SwiGLU product and the logits row of a
padded prefill.

Twins: `ops.embed` and `ops.silu(gate) * up` (the middle of `ops.swiglu_mlp`) on gate and up
rounded to bf16 (transformers' bf16 Linear outputs them so; since session 38 the backend's
long prefill chunks get them from cuBLASLt's bf16 epilogue, `gemm.Gemm.bf16_algo`). The
attention output gate is fused into attention's combine (attention.py); residual adds
into the next norm (norms.py).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import (
    IS_SIMULATOR,
    THREADS,
    bf16_to_f32,
    blocks,
    check,
    device_pointer,
    empty,
    f32_to_bf16,
    round_bf16,
)
from executor.numba_cuda.gemv import WORD, bf16_hi, bf16_lo, vector_load, vector_store
from executor.numba_cuda.launch import fast

_F32 = np.float32


@fast
@cuda.jit
def _embed_kernel(token_ids, table, out):
    # token_ids: [rows] i32; table: [vocab, hidden] bf16; out: [rows, hidden] f32
    row = u32(cuda.blockIdx.y)  # unsigned indices (all >= 0): no negative-index wraparound code
    i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if i < out.shape[1]:
        out[row, u32(i)] = bf16_to_f32(table[u32(token_ids[row]), u32(i)])


def embed(token_ids, table, out=None, stream=0):
    """out[r] = float32(table[token_ids[r]]).

    token_ids: i32 device [rows] (ids already checked against the vocabulary);
    table: uint16 (bf16) [vocab, hidden]; returns f32 [rows, hidden]. Twin: ops.embed.
    """
    check("token_ids", token_ids, np.int32, 1)
    check("table", table, np.uint16, 2)
    rows, hidden = token_ids.shape[0], table.shape[1]
    out = empty((rows, hidden), np.float32, stream) if out is None else out
    if rows:
        _embed_kernel[(blocks(hidden), rows), THREADS, stream](token_ids, table, out)
    return out


@cuda.jit(device=True, inline=True)
def _silu_mul(g, u):
    # bf16(silu(g) * u) of two bf16 values (as f32)
    silu = g / (_F32(1.0) + math.exp(-g))
    return f32_to_bf16(silu * u)


@cuda.jit(device=True, inline=True)
def _swiglu1(g, u):
    # bf16(silu(bf16(g)) * bf16(u)) of two f32 values: the bits of _silu_mul on the bf16 epilogue's
    # outputs (round_bf16: f32_to_bf16 then back, in 32-bit arithmetic)
    return _silu_mul(round_bf16(g), round_bf16(u))


@fast
@cuda.jit
def _swiglu_kernel(gate_up, out):
    # gate_up: [rows, 2 * inter] f32 (gate columns, then up columns); out: [rows, inter] bf16
    row = cuda.blockIdx.y
    i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    inter = out.shape[1]
    if i < inter:
        out[row, i] = _swiglu1(gate_up[row, i], gate_up[row, inter + i])


@cuda.jit(device=True, inline=True)
def _swiglu_word(g, u):
    # the word of two bf16 outputs from a word of two gates and a word of two ups (low half first)
    return u32(_silu_mul(bf16_lo(g), bf16_lo(u))) | (u32(_silu_mul(bf16_hi(g), bf16_hi(u))) << u32(16))


@fast
@cuda.jit
def _swiglu_bf16_kernel(gate_up, inter, out):
    # gate_up: flat WORD view of [rows, 2 * inter] bf16 (two a word); out: flat uint32 view of
    # [rows, inter] bf16; a thread takes 8 columns (two 16-byte loads, one 16-byte store: four
    # 4-byte stores ran at 1.87 TB/s, this at 3.05, bench/RESULTS.md session 39), the bits of
    # _swiglu_kernel on the f32 values these round from
    row = u32(cuda.blockIdx.y)
    i = u32((cuda.blockIdx.x * THREADS + cuda.threadIdx.x) * 8)
    if i < inter:
        base = (row * u32(2) * u32(inter) + i) >> u32(1)
        g = vector_load(gate_up, base)
        u = vector_load(gate_up, base + (u32(inter) >> u32(1)))
        vector_store(out, (row * u32(inter) + i) >> u32(1), _swiglu_word(g[0], u[0]), _swiglu_word(g[1], u[1]),
                     _swiglu_word(g[2], u[2]), _swiglu_word(g[3], u[3]))


if IS_SIMULATOR:

    def _f32(word):
        return np.uint32(word).view(np.float32)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _f32(word):
        return libdevice.int_as_float(np.int32(word))


@fast
@cuda.jit
def _swiglu4_kernel(gate_up, inter, out):
    # gate_up: flat WORD view of [rows, 2 * inter] f32; out: flat uint32 view of [rows, inter]
    # bf16; a thread takes 4 columns (two 16-byte loads, two 4-byte stores), same math as
    # _swiglu_kernel
    row = cuda.blockIdx.y
    i = (cuda.blockIdx.x * THREADS + cuda.threadIdx.x) * 4
    if i < inter:
        base = row * 2 * inter + i
        g = vector_load(gate_up, base)
        u = vector_load(gate_up, base + inter)
        o = (row * inter + i) // 2
        out[o] = np.uint32(_swiglu1(_f32(g[0]), _f32(u[0]))) | (np.uint32(_swiglu1(_f32(g[1]), _f32(u[1]))) << np.uint32(16))
        out[o + 1] = np.uint32(_swiglu1(_f32(g[2]), _f32(u[2]))) | (
            np.uint32(_swiglu1(_f32(g[3]), _f32(u[3]))) << np.uint32(16))


def swiglu(gate_up, out=None, stream=0):
    """out = bf16(silu(bf16(gate)) * bf16(up)) where gate_up = [gate | up] per row.

    gate_up: the fused gate_proj|up_proj GEMM output, device [rows, 2 * inter], f32 (rounded
    to bf16 here) or uint16 bf16 bits (cuBLASLt's bf16 epilogue: `gemm.Gemm.matmul(...,
    bf16=True)`); out: None or uint16 [rows, inter]; returns out. The same bits from an f32
    gate_up and from its bf16 rounding. Raises ValueError naming the argument on a wrong
    dtype, rank or shape, or a bf16 gate_up whose inter is not a multiple of 8, that is not
    C-contiguous or that (or out) is not 16-byte aligned. An f32 gate_up with inter % 4 == 0,
    both arrays C-contiguous, takes four columns a thread with 16-byte loads
    (`_swiglu4_kernel`), else one; a bf16 one eight a thread (`_swiglu_bf16_kernel`). Twin: ops.silu(gate) * up on bf16-rounded gate
    and up.
    """
    if getattr(gate_up, "dtype", None) == np.uint16:
        return _swiglu_bf16(gate_up, out, stream)
    check("gate_up", gate_up, np.float32, 2)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has an odd width {width}")
    inter = width // 2
    if out is not None:
        check("out", out, np.uint16, 2)
        if tuple(out.shape) != (rows, inter):
            raise ValueError(f"out {out.shape} must be [{rows}, {inter}]")
    out = empty((rows, inter), np.uint16, stream) if out is None else out
    if not rows:
        return out
    if inter % 4 == 0 and gate_up.is_c_contiguous() and out.is_c_contiguous():
        _swiglu4_kernel[(blocks(inter // 4), rows), THREADS, stream](
            gate_up.reshape(rows * width).view(WORD), inter, out.reshape(rows * inter).view(np.uint32))
    else:
        _swiglu_kernel[(blocks(inter), rows), THREADS, stream](gate_up, out)
    return out


def _swiglu_bf16(gate_up, out, stream):
    """`swiglu` of a bf16 (uint16) gate_up [rows, 2 * inter], inter % 8 == 0, C-contiguous and
    16-byte aligned, as out is (its 16-byte loads and stores; fresh allocations are)."""
    check("gate_up", gate_up, np.uint16, 2)
    rows, width = gate_up.shape
    inter = width // 2
    if width % 16 or not gate_up.is_c_contiguous():
        raise ValueError(f"a bf16 gate_up {gate_up.shape} must be C-contiguous with inter a multiple of 8")
    if not IS_SIMULATOR and rows and device_pointer(gate_up) % 16:
        raise ValueError("a bf16 gate_up must be 16-byte aligned")
    if out is not None:
        check("out", out, np.uint16, 2)
        if tuple(out.shape) != (rows, inter) or not out.is_c_contiguous():
            raise ValueError(f"out {out.shape} must be a C-contiguous [{rows}, {inter}]")
        if not IS_SIMULATOR and rows and device_pointer(out) % 16:
            raise ValueError("out of a bf16 gate_up must be 16-byte aligned")
    out = empty((rows, inter), np.uint16, stream) if out is None else out
    if rows:
        _swiglu_bf16_kernel[(blocks(inter // 8), rows), THREADS, stream](
            gate_up.reshape(rows * width).view(WORD), inter, out.reshape(rows * inter).view(np.uint32))
    return out


@fast
@cuda.jit
def _last_row_kernel(x, delta, meta, x_out, delta_out):
    # x, delta: [rows, hidden] f32; meta: i32 [>= 1] (meta[0]: the rows in use, >= 1)
    # x_out, delta_out: [1, hidden] f32 <- row meta[0] - 1 of x and of delta
    i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    row = meta[0] - 1
    if i < x.shape[1]:
        x_out[0, i] = x[row, i]
        delta_out[0, i] = delta[row, i]


@fast
@cuda.jit
def _last_x_row_kernel(x, meta, x_out):
    # x: [rows, hidden] f32; meta: i32 [>= 1]; x_out: [1, hidden] f32 <- row meta[0] - 1 of x
    i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if i < x.shape[1]:
        x_out[0, i] = x[meta[0] - 1, i]


def last_row(x, delta, meta, stream=0):
    """(x[n - 1 : n], delta[n - 1 : n]) as new f32 [1, hidden] arrays, n = meta[0] read on
    the device: the logits row of a prefill whose row count the host does not fix (a
    captured step padded to its bucket, graphs.PrefillGraphs). An exact copy, so the norm
    and LM head after it give the bits of the host slice.

    x: f32 device [rows, hidden], inner-contiguous; delta: the same, or None (the last
    projection was added into x: the second result is None); meta: i32 device [>= 1] with
    1 <= meta[0] <= rows (not checked: it lives on the device). Raises ValueError naming
    the argument on a wrong dtype, rank or shape.
    """
    check("x", x, np.float32, 2)
    check("meta", meta, np.int32, 1)
    if not x.shape[0]:
        raise ValueError(f"x {x.shape} has no rows")
    hidden = x.shape[1]
    x_out = empty((1, hidden), np.float32, stream)
    if delta is None:
        _last_x_row_kernel[blocks(hidden), THREADS, stream](x, meta, x_out)
        return x_out, None
    check("delta", delta, np.float32, 2)
    if tuple(delta.shape) != tuple(x.shape):
        raise ValueError(f"delta {delta.shape} must equal x {x.shape}, with rows")
    delta_out = empty((1, hidden), np.float32, stream)
    _last_row_kernel[blocks(hidden), THREADS, stream](x, delta, meta, x_out, delta_out)
    return x_out, delta_out
