"""Row norms: zero-centred RMSNorm with the residual add fused in front, and the gated
RMSNorm of the linear-attention output. Both write bf16, the input of the next GEMM.

Twins: `ops.rms_norm` (after `x + delta`) and `ops.gated_rms_norm`. QK-norm lives in
attention_prep.py. One block per row (add_rms_norm: on a GPU the CUDA C++ of rms_norm.cu,
the row in registers; under the simulator a numba kernel) or one warp per row and head
(gated_rms_norm); fp32 math, fixed-order reductions (a shared-memory tree, a warp
butterfly), so a row's bits never depend on the other rows.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
from numba import cuda, uint32 as u32

from executor.numba_cuda.device import (
    IS_SIMULATOR,
    THREADS,
    bf16_to_f32,
    check,
    device_pointer,
    empty,
    f32_to_bf16,
    round_bf16,
)
from executor.numba_cuda.launch import fast

_F32 = np.float32


@functools.cache
def tree_sum(threads: int):
    """A device function sum(buf, value): `value` summed over a block of `threads` threads in
    a fixed tree order (buf: shared f32 [threads]); every thread gets the sum."""

    @cuda.jit(device=True)
    def block_sum(buf, value):
        t = cuda.threadIdx.x
        ut = u32(t)  # unsigned indices: no negative-index wraparound code
        buf[ut] = value
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if t < step:
                buf[ut] += buf[u32(t + step)]
            cuda.syncthreads()
            step //= 2
        total = buf[0]
        cuda.syncthreads()
        return total

    return block_sum


block_sum = tree_sum(THREADS)
"""Sum a value over the block's THREADS threads (fixed tree order); all get the sum."""


if IS_SIMULATOR:  # device functions, so the simulator lends them its `cuda` from any module

    @cuda.jit(device=True)
    def warp_tree(value, scratch, combine):
        """`combine` of `value` over the warp's 32 lanes, in the butterfly's pairing (the
        simulator has no shuffles: a shared-memory tree, same pairs); every lane gets it."""
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        scratch[warp, lane] = value
        cuda.syncthreads()
        step = 16
        while step > 0:
            if lane < step:
                scratch[warp, lane] = combine(scratch[warp, lane], scratch[warp, lane + step])
            cuda.syncthreads()
            step //= 2
        result = scratch[warp, 0]
        cuda.syncthreads()
        return result

    @cuda.jit(device=True)
    def warp_sum(value, scratch):
        """The sum of `value` over the warp's 32 lanes; every lane gets it."""
        return warp_tree(value, scratch, lambda a, b: a + b)

    @cuda.jit(device=True)
    def warp_max(value, scratch):
        """The max of `value` over the warp's 32 lanes; every lane gets it."""
        return warp_tree(value, scratch, max)

    @cuda.jit(device=True)
    def shfl_xor(value, step, scratch):
        """Lane l gets lane l ^ step's `value` (through scratch, as `warp_tree`)."""
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        scratch[warp, lane] = value
        cuda.syncthreads()
        result = scratch[warp, lane ^ step]
        cuda.syncthreads()
        return result

    @cuda.jit(device=True)
    def shfl_idx(value, src, scratch):
        """Every lane gets lane `src`'s `value` (through scratch, as `warp_tree`)."""
        warp = cuda.threadIdx.x // 32
        scratch[warp, cuda.threadIdx.x % 32] = value
        cuda.syncthreads()
        result = scratch[warp, src]
        cuda.syncthreads()
        return result

else:

    @cuda.jit(device=True, inline=True)
    def warp_sum(value, scratch):
        """The sum of `value` over the warp's 32 lanes (xor butterfly); every lane gets it.
        scratch: shared f32 [warps of the block, 32], used only by the simulator's twin,
        which synchronises the block: every thread of the block must call it."""
        for step in (16, 8, 4, 2, 1):
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, step)
        return value

    @cuda.jit(device=True, inline=True)
    def warp_max(value, scratch):
        """The max of `value` over the warp's 32 lanes (xor butterfly); every lane gets it.
        scratch and callers: as `warp_sum`."""
        for step in (16, 8, 4, 2, 1):
            value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, step))
        return value

    @cuda.jit(device=True, inline=True)
    def shfl_xor(value, step, scratch):
        """Lane l gets lane l ^ step's `value`. scratch and callers: as `warp_sum`."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, step)

    @cuda.jit(device=True, inline=True)
    def shfl_idx(value, src, scratch):
        """Every lane gets lane `src`'s `value`. scratch and callers: as `warp_sum`."""
        return cuda.shfl_sync(0xFFFFFFFF, value, src)


@cuda.jit(device=True, inline=True)
def _halve(v, half, step, lane, scratch):
    """One step of `warp_sum_rows`: `half` == 0: v[0] += lane l ^ step's v[0] (the butterfly's
    step); else lanes whose bit `step` is clear keep rows v[:half], the others v[half:2 half],
    each adding the partner lane's value of the kept row (v[k] = kept + partner's, into v[:half])."""
    if half == 0:
        v[0] = v[0] + shfl_xor(v[0], step, scratch)
        return
    high = (lane & step) != 0
    for k in range(half):
        a = v[k]
        b = v[k + half]
        v[k] = (b if high else a) + shfl_xor(a if high else b, step, scratch)


@cuda.jit(device=True, inline=True)
def warp_sum_rows(v, count, scratch):
    """`warp_sum` of `count` rows at once (count a power of two up to 32, a compile-time
    constant; v: local f32 [count], row i's value in v[i]): lane l returns the sum of row
    l >> (5 - log2 count) (lanes 0-3 row 0 ... for 8 rows), v clobbered. Each step of the xor
    butterfly (16, 8, ... 1) adds a lane's value and its partner's as `warp_sum` does, but the
    two partners split the rows they still hold (a reduce-scatter): 8 rows cost 4 + 2 + 1 + 1 +
    1 shuffles and adds instead of 40, and the sums are `warp_sum`'s bits (a + b = b + a).
    Every thread of the block must call it (`warp_sum`'s simulator twin synchronises)."""
    lane = cuda.threadIdx.x % 32
    _halve(v, count >> 1, 16, lane, scratch)
    _halve(v, count >> 2, 8, lane, scratch)
    _halve(v, count >> 3, 4, lane, scratch)
    _halve(v, count >> 4, 2, lane, scratch)
    _halve(v, count >> 5, 1, lane, scratch)
    return v[0]



@cuda.jit(device=True, inline=True)
def fold_wide(buf, first, count):
    """Steps THREADS / 2 .. 32 of the fixed tree that sums each of rows [first, first + count)
    of buf (shared f32 [rows, THREADS], a value a slot) into its first 32 slots, a barrier
    after each step: every thread of the block calls it (thread t works slot t % THREADS).
    `warp_sum(buf[r, lane], scratch)` then gives every lane row r's tree sum: the xor
    butterfly adds the pairs of the tree's steps 16 .. 1 (a + b = b + a bit for bit), so the
    bits are those of `block_sum`'s whole tree over THREADS slots."""
    t = cuda.threadIdx.x % THREADS
    step = THREADS // 2
    while step >= 32:
        if t < step:
            for r in range(first, first + count):  # unsigned indices: no wraparound code
                buf[u32(r), u32(t)] += buf[u32(r), u32(t + step)]
        cuda.syncthreads()
        step //= 2


NORM_THREADS = 1024
"""Threads per row of `add_rms_norm` in decode: a decode row is one block, so the row's
loads must all be in flight at once (a hidden row of 5120 is 5 loads per thread)."""
PREFILL_NORM_THREADS = 256
"""Threads per row of `add_rms_norm` in prefill, whatever the chunk's row count (a row's
bits depend on this count, so it must not follow the rows): thousands of rows fill the GPU
anyway, and a 1024-thread block spends its time in the ten-level reduction tree."""


NORM_UNROLL = 4
"""Elements a thread of `add_rms_norm` loads at once by default. A prefill row is one
256-thread block (27B: 20 elements a thread), and a short chunk is a block or two per SM,
so each round of loads is a memory latency. CUPTI, 27B width (bench/RESULTS.md, session
15): 51 rows 12.5 us a call one at a time, 10.2 four at a time, 10.5 all 20; 8192 rows
252, 206 and 255 us (more at once costs occupancy)."""
MAX_UNROLL = 32
"""Most elements a thread of `add_rms_norm` may load at once."""


@functools.cache
def _add_rms_norm_kernel_for(threads: int, unroll: int):
    """The fused residual add + RMSNorm with `threads` threads per row (a fixed-order
    shared-memory tree over them). Each thread sums its elements t, t + threads, ... in
    that order whatever `unroll` is: it loads them `unroll` at a time (every load of a group
    in flight together; an element past the row is neither read nor summed), then adds them
    in order, so `unroll` changes no bit."""

    wide_sum = tree_sum(threads)
    span = threads * unroll

    @fast
    @cuda.jit
    def _add_rms_norm_kernel(x, delta, has_delta, weight, eps, out):
        # x: [rows, dim] f32 (updated in place when has_delta); delta: [rows, dim] f32
        # weight: [dim] f32; out: [rows, dim] bf16; `threads` threads per row
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        dim = x.shape[1]
        buf = cuda.shared.array(threads, np.float32)
        group = cuda.local.array(unroll, np.float32)
        ssq = _F32(0.0)
        for base in range(t, dim, span):
            for u in range(unroll):  # every load of the group first (x and delta may alias)
                i = base + u * threads
                if i < dim:
                    group[u] = x[row, i]
            if has_delta:
                for u in range(unroll):
                    i = base + u * threads
                    if i < dim:
                        group[u] = group[u] + delta[row, i]
                for u in range(unroll):
                    i = base + u * threads
                    if i < dim:
                        x[row, i] = group[u]
            for u in range(unroll):
                if base + u * threads < dim:
                    ssq += group[u] * group[u]
        total = wide_sum(buf, ssq)
        inv = _F32(1.0) / math.sqrt(total / _F32(dim) + _F32(eps))
        for base in range(t, dim, span):
            for u in range(unroll):
                i = base + u * threads
                if i < dim:
                    group[u] = x[row, i]
            for u in range(unroll):
                i = base + u * threads
                if i < dim:
                    out[row, i] = f32_to_bf16(group[u] * inv * (_F32(1.0) + weight[i]))

    return _add_rms_norm_kernel


FUSED_SOURCE = Path(__file__).with_name("rms_norm.cu")
"""The CUDA C++ of the register-resident norm (`add_rms_norm` on a GPU)."""
FUSED_VEC = {256: 8, 1024: 2}
"""Threads per row the C++ norm is instantiated for, and the most float4s a thread holds
(the widest row: 8,192 at 256 threads, 8,192 at 1,024)."""


def fused_unavailable(dim: int, threads: int) -> str | None:
    """Why the C++ norm (rms_norm.cu) cannot take rows of `dim` at `threads` threads a row
    (None when it can): the simulator, a thread count or width it is not built for, a width
    that is not a whole number of float4s, or a failed compile (tried once a process)."""
    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC"
    if threads not in FUSED_VEC:
        return f"threads {threads} is not one of {sorted(FUSED_VEC)}"
    if dim % 4 or not 0 < dim <= 4 * FUSED_VEC[threads] * threads:
        return f"dim {dim} is not a multiple of 4 in [4, {4 * FUSED_VEC[threads] * threads}]"
    return _fused_compile_error(threads, -(-dim // (4 * threads)))


@functools.cache
def _fused_kernel(threads: int, vec: int):
    """The launchable C++ norm with `threads` threads a row and `vec` float4s a thread
    (compiled now, with link-time optimisation, as attention_flash.kernel)."""
    device_fn = cuda.declare_device(f"add_rms_norm_{threads}_{vec}", "int32(int64, int64, int64, int64, float32, int64, int64)")

    @cuda.jit("void(int64, int64, int64, int64, float32, int64, int64)", link=[str(FUSED_SOURCE)], lto=True,
              launch_bounds=(threads, 1))
    def fused_add_rms_norm(x, delta, has_delta, weight, eps, out, dim):
        device_fn(x, delta, has_delta, weight, eps, out, dim)

    return fast(fused_add_rms_norm)


@functools.cache
def _fused_compile_error(threads: int, vec: int) -> str | None:
    """Why `_fused_kernel(threads, vec)` does not compile here (no NVRTC or nvJitLink, an
    old GPU), or None; asked once a process."""
    try:
        _fused_kernel(threads, vec)
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"rms_norm.cu does not compile: {exc!r}"[:300]
    return None


def add_rms_norm(x, weight, eps: float, delta=None, out=None, stream=0, threads: int = NORM_THREADS,
                 unroll: int = NORM_UNROLL, fused: bool | None = None):
    """x += delta (when given, in place), then out = bf16(rms_norm(x, weight, eps)).

    x: f32 device [rows, dim] (rows may be a row slice); delta: f32 [rows, dim] or None;
    weight: f32 [dim]; threads: per row, a power of two up to 1024 (NORM_THREADS for decode,
    PREFILL_NORM_THREADS for prefill: a row's bits depend on it, never on the rows);
    unroll: elements a thread of numba's kernel loads at once (NORM_UNROLL; no bit depends
    on it); fused: run rms_norm.cu, the row in registers (default: where it can,
    `fused_unavailable`; its bits differ from numba's kernel, so a backend keeps one for
    good: the default is fixed by the GPU, dim and threads). Returns out: uint16 (bf16 bits)
    [rows, dim]. Raises ValueError naming the argument on a wrong dtype, rank or shape, and
    for the C++ norm on rows that are not C-contiguous and 16-byte aligned.
    Twin: ops.rms_norm(x + delta, weight, eps).
    """
    check("x", x, np.float32, 2)
    check("weight", weight, np.float32, 1)
    rows, dim = x.shape
    if weight.shape[0] != dim:
        raise ValueError(f"weight has {weight.shape[0]} entries, x has {dim} columns")
    if threads not in (32, 64, 128, 256, 512, 1024):
        raise ValueError(f"threads must be a power of two in [32, 1024], got {threads}")
    if not 1 <= unroll <= MAX_UNROLL:
        raise ValueError(f"unroll must be in [1, {MAX_UNROLL}], got {unroll}")
    if delta is not None:
        check("delta", delta, np.float32, 2)
        if tuple(delta.shape) != tuple(x.shape):
            raise ValueError(f"delta shape {delta.shape} != x shape {x.shape}")
    if out is not None:
        check("out", out, np.uint16, 2)
        if tuple(out.shape) != (rows, dim):
            raise ValueError(f"out {out.shape} must be [{rows}, {dim}]")
    out = empty((rows, dim), np.uint16, stream) if out is None else out
    why = fused_unavailable(dim, threads) if fused is not False else None
    if fused is None:
        fused = why is None
    if fused and rows:
        if why is not None:
            raise ValueError(f"the C++ norm cannot run: {why}")
        for name, array, align in (("x", x, 16), ("delta", delta, 16), ("weight", weight, 16), ("out", out, 8)):
            if array is None:
                continue
            if not array.is_c_contiguous() or device_pointer(array) % align:
                raise ValueError(f"{name} must be C-contiguous and {align}-byte aligned for the C++ norm")
        vec = -(-dim // (4 * threads))
        _fused_kernel(threads, vec)[rows, threads, stream](
            device_pointer(x), device_pointer(x if delta is None else delta), int(delta is not None),
            device_pointer(weight), np.float32(eps), device_pointer(out), dim)
        return out
    if rows:
        has = 1 if delta is not None else 0
        kernel = _add_rms_norm_kernel_for(threads, unroll)
        kernel[rows, threads, stream](x, x if delta is None else delta, has, weight, eps, out)
    return out


GATED_WARPS = 8
"""Heads of one row per block of `gated_rms_norm` (one warp each; a row of fewer heads leaves
warps idle). Knob: more warps a block are fewer, larger blocks; no bit depends on it."""


@functools.cache
def _gated_rms_norm_kernel_for(dim: int, warps: int, bf16_gate: bool = False):
    """The gated RMSNorm kernel for heads of `dim`, `warps` heads of one row a block (grid: rows,
    head groups): each lane loads its dim / 32 values of x and of the gate before it sums any (a
    lane that loaded, summed and loaded again had one load in flight: ~1.2 TB/s at the 9B's
    shapes, bench/RESULTS.md session 28), in the same order as ever: lane's dims lane, lane + 32,
    ... from 0, then the xor butterfly; each output is the same float expression as ever.

    Instructions, not bytes, bounded it (Nsight Compute on the H100, 9B, 8192 rows, session 37:
    DRAM 70%, issue slots 78% busy, ~430 instructions a warp). The (row, head) of a warp came
    from a 64-bit division and modulo of its pair number by the head count (a division routine a
    warp); now from the block's two grid indices. Lane and head are unsigned 32-bit values, so
    no index has wraparound or sign code, and the bf16 of an output is rounded in 32-bit
    arithmetic (device.f32_to_bf16, the same bits): the 9B's 32K prefill's gated norms 15.7 ->
    11.5 ms on the H100, the same logits bits (bench/RESULTS.md, session 37).

    The gate is rounded to bf16 first (transformers' in_proj_z is a bf16 Linear's output; since
    session 39): an f32 gate as it is loaded, a uint16 one (`bf16_gate`: in_proj's product from
    cuBLASLt's bf16 epilogue) is those bits already, so both give the same outputs."""
    n = max(1, -(-dim // 32))  # values a lane holds
    gate_value = bf16_to_f32 if bf16_gate else round_bf16

    @fast
    @cuda.jit
    def _gated_rms_norm_kernel(x, gate, weight, eps, out):
        # x: [rows, heads, dim] f32; gate: [rows, heads * dim] f32 or bf16; weight: [dim] f32
        # out: [rows, heads * dim] bf16; one warp per (row, head)
        tid = u32(cuda.threadIdx.x)
        lane = tid % u32(32)
        row = u32(cuda.blockIdx.x)
        head = u32(u32(cuda.blockIdx.y) * u32(warps) + tid // u32(32))
        scratch = cuda.shared.array((warps, 32), np.float32)  # the simulator's warp tree only
        live = head < x.shape[1]
        if not live:
            head = u32(0)  # idle warps of the row's last block compute a real head and store nothing
        col = u32(head * u32(dim))  # the head's first column of gate and out
        xs = cuda.local.array(n, np.float32)
        gs = cuda.local.array(n, np.float32)
        for k in range(n):
            i = u32(lane + u32(32 * k))
            if i < dim:
                xs[k] = x[row, head, i]
                gs[k] = gate_value(gate[row, u32(col + i)])
        ssq = _F32(0.0)
        for k in range(n):
            if u32(lane + u32(32 * k)) < dim:
                ssq += xs[k] * xs[k]
        ssq = warp_sum(ssq, scratch)
        inv = _F32(1.0) / math.sqrt(ssq / _F32(dim) + _F32(eps))
        if live:
            for k in range(n):
                i = u32(lane + u32(32 * k))
                if i < dim:
                    g = gs[k]
                    silu = g / (_F32(1.0) + math.exp(-g))
                    out[row, u32(col + i)] = f32_to_bf16(xs[k] * inv * weight[i] * silu)

    return _gated_rms_norm_kernel


def gated_rms_norm(x, gate, weight, eps: float, out=None, stream=0):
    """out = bf16(rms_norm(x) * weight * silu(bf16(gate))) per head.

    x: f32 [rows, heads, dim]; gate: f32 or uint16 (bf16 bits) [rows, heads * dim] (may be a
    column slice of a wider GEMM output; an f32 gate gives the bits of its bf16 rounding);
    weight: f32 [dim]; returns uint16 (bf16) [rows, heads * dim].
    One warp per (row, head): a lane sums dims lane, lane + 32, ... then a fixed xor
    butterfly; a row's bits never depend on the other rows. Raises ValueError naming the
    argument on a wrong dtype or rank, or when gate or weight do not fit x. Twin:
    ops.gated_rms_norm on the bf16-rounded gate (its output flattened per row).
    """
    check("x", x, np.float32, 3)
    bf16_gate = getattr(gate, "dtype", None) == np.uint16
    check("gate", gate, np.uint16 if bf16_gate else np.float32, 2)
    check("weight", weight, np.float32, 1)
    rows, heads, dim = x.shape
    if tuple(gate.shape) != (rows, heads * dim) or weight.shape[0] != dim:
        raise ValueError(f"gate {gate.shape} / weight {weight.shape} do not fit x {x.shape}")
    out = empty((rows, heads * dim), np.uint16, stream) if out is None else out
    if rows:
        warps = GATED_WARPS
        _gated_rms_norm_kernel_for(dim, warps, bf16_gate)[(rows, -(-heads // warps)), warps * 32, stream](
            x, gate, weight, eps, out)
    return out

