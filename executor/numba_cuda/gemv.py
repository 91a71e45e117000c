"""Row-invariant bf16 GEMV-style product for few rows (decode lanes, the LM head row), and the
16-byte vector load and store (`vector_load`, `vector_store`) other kernels share.

out[r, n] = sum_k x[r, k] * w[n, k] with bf16 inputs and fp32 accumulation. One warp owns
one output column: lane l reads the 16-byte chunks (8 bf16) l, l + 32, l + 64, ... of the
weight row and of each x row (coalesced: 512 bytes per warp load, four loads in flight),
and keeps one fp32 sum per x row, advanced by explicit fused multiply-adds in ascending k;
the 32 lane sums then meet in a fixed shared-memory tree. A row's operations never depend
on how many rows share the launch or on its slot among them, so a lane's bits do not
depend on the other lanes (concurrent == solo). Up to GROUP_ROWS rows share one pass over
the weights. Twin: ops.linear.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, THREADS, check, device_pointer, empty
from executor.numba_cuda.launch import fast

WARP = 32
WARPS = THREADS // WARP
"""Output columns per block (one per warp)."""
CHUNK = 8
"""bf16 values per 16-byte load; K must be a multiple of this."""
GROUP_ROWS = 16
"""Rows sharing one pass over the weights; more rows run in groups of this."""
_GROUPS = (1, 2, 4, 8, 16)
_F32 = np.float32

if IS_SIMULATOR:

    def load16(array, i):
        """The four uint32 words array[i : i + 4] (one 16-byte load on the GPU)."""
        return array[i], array[i + 1], array[i + 2], array[i + 3]

    def store16(array, i, a, b, c, d):
        """array[i : i + 4] = a, b, c, d (one 16-byte store on the GPU)."""
        array[i], array[i + 1], array[i + 2], array[i + 3] = a, b, c, d

    def bf16_lo(word):
        """The float32 value of the low bf16 half of a uint32 word."""
        return np.uint32(np.uint32(word) << np.uint32(16)).view(np.float32)

    def bf16_hi(word):
        """The float32 value of the high bf16 half of a uint32 word."""
        return np.uint32(np.uint32(word) & np.uint32(0xFFFF0000)).view(np.float32)

else:
    import numba
    from llvmlite import ir
    from numba.cuda import libdevice
    from numba.cuda import types as _cuda_types
    from numba.cuda.extending import intrinsic

    _types = _cuda_types if hasattr(_cuda_types, "UniTuple") else numba.types

    @intrinsic
    def load16(typingctx, array, index):
        """The four uint32 words array[i : i + 4] of a 1-D uint32 array in one
        ld.global.nc.v4.u32 (the address must be 16-byte aligned; the data read-only
        for the kernel's lifetime)."""
        if getattr(array, "ndim", None) != 1 or str(getattr(array, "dtype", "")) != "uint32":
            return None
        sig = _types.UniTuple(_types.uint32, 4)(array, index)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            ptr = builder.gep(data, [args[1]])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32, i32, i32, i32]), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            words = builder.call(asm, [ptr])
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(words, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def store16(typingctx, array, index, a, b, c, d):
        """array[i : i + 4] = a, b, c, d of a 1-D uint32 array in one st.global.v4.u32 (the
        address must be 16-byte aligned). A warp's 16-byte stores fill whole 32-byte sectors;
        four 4-byte stores a thread at a 16-byte stride touch each sector four times, which held
        the bf16 SwiGLU to 1.87 TB/s against 3.05 with this (bench/RESULTS.md, session 39)."""
        if getattr(array, "ndim", None) != 1 or str(getattr(array, "dtype", "")) != "uint32":
            return None
        sig = _types.none(array, index, a, b, c, d)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            ptr = builder.gep(data, [args[1]])
            i32 = ir.IntType(32)
            words = [w if w.type.width == 32 else builder.trunc(w, i32) if w.type.width > 32 else builder.zext(w, i32)
                     for w in args[2:]]
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32, i32])
            asm = ir.InlineAsm(fnty, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effect=True)
            builder.call(asm, [ptr] + words)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def bf16_lo(word):
        """The float32 value of the low bf16 half of a uint32 word."""
        return libdevice.int_as_float(np.int32(word << np.uint32(16)))

    @cuda.jit(device=True, inline=True)
    def bf16_hi(word):
        """The float32 value of the high bf16 half of a uint32 word."""
        return libdevice.int_as_float(np.int32(word & np.uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def load8x2(array, i):
    """The same four uint32 words as `load16`, from a 1-D uint64 view in two 8-byte loads
    (the fallback when this numba-cuda cannot lower `load16`; identical bits)."""
    a = array[i >> 1]
    b = array[(i >> 1) + 1]
    low = np.uint64(0xFFFFFFFF)
    return np.uint32(a & low), np.uint32(a >> np.uint64(32)), np.uint32(b & low), np.uint32(b >> np.uint64(32))


@cuda.jit(device=True, inline=True)
def store4x4(array, i, a, b, c, d):
    """The words of `store16` in four 4-byte stores (the fallback when this numba-cuda cannot
    lower `store16`; the same memory after)."""
    array[i] = a
    array[i + 1] = b
    array[i + 2] = c
    array[i + 3] = d


@cuda.jit(device=True, inline=True)
def _dot8(w, x, acc):
    """acc advanced by the eight bf16 products of two 16-byte chunks, in ascending k."""
    acc = cuda.fma(bf16_lo(w[0]), bf16_lo(x[0]), acc)
    acc = cuda.fma(bf16_hi(w[0]), bf16_hi(x[0]), acc)
    acc = cuda.fma(bf16_lo(w[1]), bf16_lo(x[1]), acc)
    acc = cuda.fma(bf16_hi(w[1]), bf16_hi(x[1]), acc)
    acc = cuda.fma(bf16_lo(w[2]), bf16_lo(x[2]), acc)
    acc = cuda.fma(bf16_hi(w[2]), bf16_hi(x[2]), acc)
    acc = cuda.fma(bf16_lo(w[3]), bf16_lo(x[3]), acc)
    return cuda.fma(bf16_hi(w[3]), bf16_hi(x[3]), acc)


def _make_kernel(group_rows: int, load16):
    @fast
    @cuda.jit
    def kernel(x32, w32, chunks, out):
        # x32: [rows * K / 2] u32 (bf16 pairs, row-major), or its u64 view for load8x2;
        # w32: [N * K / 2] u32 likewise; indices count u32 words. chunks: K / 8; out: [rows, N] f32
        t = cuda.threadIdx.x
        lane = t % WARP
        warp = t // WARP
        n = cuda.blockIdx.x * WARPS + warp
        r0 = cuda.blockIdx.y * group_rows
        nr = out.shape[0] - r0
        if nr > group_rows:
            nr = group_rows
        row_words = chunks * 4
        acc = cuda.local.array(group_rows, np.float32)
        for r in range(group_rows):
            acc[r] = _F32(0.0)
        if n < out.shape[1]:
            wb = n * row_words
            xb = r0 * row_words
            j = lane
            while j + 3 * WARP < chunks:
                a = load16(w32, wb + 4 * j)
                b = load16(w32, wb + 4 * (j + WARP))
                c = load16(w32, wb + 4 * (j + 2 * WARP))
                d = load16(w32, wb + 4 * (j + 3 * WARP))
                for r in range(group_rows):
                    if r < nr:
                        xr = xb + r * row_words + 4 * j
                        s = _dot8(a, load16(x32, xr), acc[r])
                        s = _dot8(b, load16(x32, xr + 4 * WARP), s)
                        s = _dot8(c, load16(x32, xr + 8 * WARP), s)
                        acc[r] = _dot8(d, load16(x32, xr + 12 * WARP), s)
                j += 4 * WARP
            while j < chunks:
                a = load16(w32, wb + 4 * j)
                for r in range(group_rows):
                    if r < nr:
                        acc[r] = _dot8(a, load16(x32, xb + r * row_words + 4 * j), acc[r])
                j += WARP
        buf = cuda.shared.array((WARPS, group_rows, WARP), np.float32)
        for r in range(group_rows):
            buf[warp, r, lane] = acc[r]
        cuda.syncthreads()
        half = WARP // 2
        while half > 0:
            if lane < half:
                for r in range(group_rows):
                    buf[warp, r, lane] += buf[warp, r, lane + half]
            cuda.syncthreads()
            half //= 2
        if n < out.shape[1] and lane < nr:
            out[r0 + lane, n] = buf[warp, lane, 0]

    return kernel


def _vector_loads_lower() -> bool:
    """Whether this numba-cuda compiles `load16` (checked once at import, no launch)."""
    if IS_SIMULATOR:
        return True

    def probe(a, out):
        out[0] = load16(a, 0)[1]

    try:
        cuda.compile_ptx(probe, (_types.uint32[::1], _types.uint32[::1]), cc=(9, 0))
    except Exception as exc:  # noqa: BLE001 - any typing or lowering failure selects the fallback
        warnings.warn(f"16-byte GEMV loads unavailable ({type(exc).__name__}: {exc}); using 2 x 8-byte loads")
        return False
    return True


def _vector_stores_lower() -> bool:
    """Whether this numba-cuda compiles `store16` (checked once at import, no launch)."""
    if IS_SIMULATOR:
        return True

    def probe(out, word):
        # uint64 words, as `u32 | u32 << u32` types (the bf16 SwiGLU's): the truncating lowering
        store16(out, 0, word, word | np.uint64(1), np.uint32(3), np.uint32(4))

    try:
        cuda.compile_ptx(probe, (_types.uint32[::1], _types.uint64), cc=(9, 0))
    except Exception as exc:  # noqa: BLE001 - any typing or lowering failure selects the fallback
        warnings.warn(f"16-byte stores unavailable ({type(exc).__name__}: {exc}); using 4 x 4-byte stores")
        return False
    return True


VECTOR_LOADS = _vector_loads_lower()
"""True when the GEMV reads with 16-byte loads, False on the 2 x 8-byte fallback."""
WORD = np.uint32 if VECTOR_LOADS else np.uint64
"""The dtype `vector_load` indexes: a uint32 view (16-byte loads) or a uint64 one (the fallback)."""
vector_load = load16 if VECTOR_LOADS else load8x2
"""The 16-byte read this numba-cuda lowers: four uint32 words at a uint32 index of a 1-D
`WORD` view (`load16`, or the bit-identical `load8x2`)."""
VECTOR_STORES = _vector_stores_lower()
"""True when `vector_store` is one 16-byte store, False on the 4 x 4-byte fallback."""
vector_store = store16 if VECTOR_STORES else store4x4
"""The 16-byte write this numba-cuda lowers: four uint32 words at a uint32 index of a 1-D
uint32 array (`store16`, or `store4x4`: the same memory after)."""
_KERNELS = {g: _make_kernel(g, vector_load) for g in _GROUPS}


def group_rows_for(rows: int) -> int:
    """The row-group size a launch of `rows` rows uses (a power of two up to GROUP_ROWS)."""
    return next(g for g in _GROUPS if g >= min(rows, GROUP_ROWS))


def gemv(x, weight, out=None, stream=0):
    """out = float32(x @ weight.T), each row reduced in a row-count-independent order.

    x: uint16 (bf16) device [rows, K]; weight: uint16 (bf16) [N, K]; both C-contiguous
    and 16-byte aligned (fresh allocations are); K % 8 == 0. Returns f32 [rows, N].
    Raises ValueError on other shapes or layouts. Twin: ops.linear on the float32 values.
    """
    check("x", x, np.uint16, 2)
    check("weight", weight, np.uint16, 2)
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has {k}")
    if k % CHUNK:
        raise ValueError(f"K = {k} must be a multiple of {CHUNK}")
    if not (x.is_c_contiguous() and weight.is_c_contiguous()):
        raise ValueError("x and weight must be C-contiguous")
    if not IS_SIMULATOR and (device_pointer(x) % 16 or device_pointer(weight) % 16):
        raise ValueError("x and weight must start on a 16-byte boundary")
    out = empty((rows, n), np.float32, stream) if out is None else out
    if rows and n:
        group = group_rows_for(rows)
        x32 = x.reshape(rows * k).view(WORD)
        w32 = weight.reshape(n * k).view(WORD)
        grid = ((n + WARPS - 1) // WARPS, (rows + group - 1) // group)
        _KERNELS[group][grid, THREADS, stream](x32, w32, k // CHUNK, out)
    return out
