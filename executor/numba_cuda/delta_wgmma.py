"""Phase 2 of the tensor-core delta rule (delta_mma.py's walk) on the H100/H200's warpgroup
instructions (delta_wgmma.cu): the same tf32 products in the same order as the mma.sync walk,
so every output and state bit the same where wgmma's tf32 sums are chained mma.sync m16n8k8's,
which `status` checks on this GPU before first use.

numba's `link=` compiles for sm_90, which has no wgmma, so NVRTC compiles delta_mma.cu's text
with delta_wgmma.cu's appended for sm_90a (nvrtc.py) and the driver launches the cubin on
numba's streams and memory, as attention_wgmma.py does for prefill attention. Built for key dim
128, split 3 and a walk shape of (32 or 64 columns, 8 warps); delta_mma.delta_mma takes it by
default at 64 columns (`FASTER`: the 27B's shape, 11-13% faster on the H100) when `status()` is
None, and at 32 (the 9B's: no faster) only when asked (wgmma=True). WARMSTATE_DELTA_WGMMA=0 turns
the default off.

Not available under the CUDA simulator (no NVRTC, no wgmma) or without cuda-bindings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from executor.numba_cuda.delta_chunked import SUBCHUNK_ROWS

SOURCE = Path(__file__).with_name("delta_wgmma.cu")
"""The walk's CUDA C++ (appended to delta_mma.cu's)."""
DELTA_SOURCE = Path(__file__).with_name("delta_mma.cu")
"""delta_mma.SOURCE: the helpers the walk calls (tf32, split_store, copy16, WalkCopies, ...)."""
KEY_DIM = 128
"""The only key dim the walk is built for (every Qwen3.5 linear-attention layer's)."""
COLUMNS = (32, 64)
"""State columns a CTA (BV) the cubin holds a walk for."""
FASTER = (64,)
"""State columns a CTA at which delta_mma takes this walk by default: where it measured faster than
the mma.sync walk (H100, 132 multiprocessors, bench/RESULTS.md session 40: whole delta_mma calls
at the 27B's 48 value heads and 64 columns 0.869x at 8,192 rows from 24,576 and 0.892x at 32,768
from 0; at the 9B's 32 value heads and 32 columns 0.963x and 1.007x, and its 32K prefill's delta
rule 149.0 -> 152.3 ms, so 32 stays on mma.sync unless asked for). Keyed on the columns only: on
a GPU with fewer multiprocessors, where walk_shape gives the 9B 64 columns too, the 9B takes it
at a shape it was not timed at (same bits)."""
THREADS = 256
"""Threads a CTA: 8 warps, 2 warpgroups."""
SPLIT = 3
"""The only tf32 split the walk is built for (delta_mma's default)."""


def shared_bytes(bv: int) -> int:
    """Dynamic shared memory of the walk at BV state columns (WgWalkSmem<128, bv>::FLOATS * 4)."""
    c, kd, p = SUBCHUNK_ROWS, KEY_DIM, 36
    fixed = 2 * c * (kd + 4) + c * (kd + 8) + c * (c + 4)
    return 4 * (fixed + 2 * (bv // 8) * (kd // 4) * p + 2 * (bv // 8) * (c // 4) * p + 2 * c)


def kernel_name(bv: int) -> str:
    """The launchable walk's name in the cubin at BV state columns."""
    return f"delta_walk_wgmma_{KEY_DIM}_{bv}"


def source() -> str:
    """The cubin's CUDA C++: delta_mma.cu, wgmma.cu, then delta_wgmma.cu with its wgmma functions."""
    from executor.numba_cuda.attention_wgmma import WGMMA_SOURCE
    from executor.numba_cuda.nvrtc import wgmma_function

    functions = "".join(wgmma_function(f"wgmma_tf32_n{n}", n, True, False, "tf32") for n in COLUMNS)
    return (DELTA_SOURCE.read_text() + "\n" + WGMMA_SOURCE.read_text()
            + SOURCE.read_text().replace("// @WGMMA_FUNCTIONS@", functions))


@functools.cache
def module():
    """The compiled walks (nvrtc.Module, dynamic shared memory allowed), built once a process.
    Raises RuntimeError where they cannot be built (attention_wgmma.unavailable, NVRTC's log)."""
    from executor.numba_cuda import attention_wgmma
    from executor.numba_cuda.nvrtc import Module, compile_cubin

    why = attention_wgmma.unavailable()
    if why is not None:
        raise RuntimeError(f"wgmma delta walk: {why}")
    cubin, _ = compile_cubin(source(), "delta_wgmma.cu")
    built = Module(cubin)
    for bv in COLUMNS:
        built.function(kernel_name(bv), shared_bytes(bv))
    return built


def fits(key_dim: int, bv: int, warps: int, split: int) -> bool:
    """Whether a walk of this shape has a wgmma build (key dim 128, 32 or 64 columns, 8 warps, split 3)."""
    return key_dim == KEY_DIM and bv in COLUMNS and warps == 8 and split == SPLIT


def chosen(key_dim: int, bv: int, warps: int, split: int) -> bool:
    """Whether delta_mma's default (wgmma=None) walks this shape on wgmma: it fits, its columns are
    in FASTER, and `status()` is None (the walk runs here and gave the mma.sync walk's bits)."""
    return fits(key_dim, bv, warps, split) and bv in FASTER and status() is None


def launch(q, k, w, u, m, dv, states, slot_bytes: int, out, meta, key_heads: int, value_heads: int,
           value_dim: int, bv: int, stream=0) -> None:
    """The walk over a chunk whose phase 1 wrote w, u, m and dv: delta_mma's phase-2 launch with
    the same arguments (device pointers as ints for q, k, w, u, m, dv, states and out; meta, i32
    device [3] = (rows in use, start row, slot), read on the device), grid (value_dim / bv,
    value_heads). Raises RuntimeError where the walk cannot run (`module`) or the launch fails."""
    pointers = [np.int64(a) for a in (q, k, w, u, m, dv, states)]  # 8 bytes each, as the pointers they are
    module().launch(kernel_name(bv), (value_dim // bv, value_heads), THREADS, shared_bytes(bv), *pointers,
                    np.int64(slot_bytes), np.int64(out), meta, key_heads, value_heads, value_dim, wait=False,
                    stream=stream)


OFF = "turned off by WARMSTATE_DELTA_WGMMA=0"
"""`status` when the environment turns the walk off."""


@functools.cache
def status() -> str | None:
    """None when delta_mma may walk on wgmma here, else why not: WARMSTATE_DELTA_WGMMA=0 (OFF),
    it cannot be built (`module`), or the check raised or found a bit that differs from the
    mma.sync walk's (random inputs at 2 key heads and 4 value heads, 200 rows from row 30, 64
    rows from 0, and 130 from 70 with v and the state spread over 2^-12..2^12 and fast gates:
    partial first and last sub-chunks, every state column, both column splits). Decided once a
    process, whatever the outcome; it launches and synchronizes, so delta_mma.probe (run before a
    backend's first prefill) decides it, where the model's walk would take it, before any stream
    capture. The equality is observed on these inputs, not proven: that wgmma's tf32 sums are
    chained mma.sync m16n8k8's is what the check finds on the GPU at hand."""
    if os.environ.get("WARMSTATE_DELTA_WGMMA", "1").strip() == "0":
        return OFF
    try:
        module()
        return _check()
    except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or the check: the mma.sync walk runs
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


def _check() -> str | None:
    """`status`'s bit check: None when both walks give every output and state bit alike."""
    from numba import cuda

    from executor.numba_cuda import delta_mma
    from executor.reference import ops

    rng = np.random.default_rng(40)
    key_heads, value_heads, kd, vd = 2, 4, KEY_DIM, 128
    # the third case spreads the exponents: v and the state over 2^+-12, gates down to e^-8 a row
    for rows, start, spread, decay in ((200, 30, 0, 0.5), (64, 0, 0, 0.5), (130, 70, 12, 8.0)):
        q = ops.l2_normalize(rng.normal(size=(rows, key_heads, kd))).astype(np.float32) * np.float32(kd**-0.5)
        k = ops.l2_normalize(rng.normal(size=(rows, key_heads, kd))).astype(np.float32)
        scale = np.exp2(rng.integers(-spread, spread + 1, (rows, value_heads * vd)))
        v = (rng.normal(size=(rows, value_heads * vd)) * scale).astype(np.float32)
        g = -rng.uniform(0.01, decay, (rows, value_heads)).astype(np.float32)
        beta = rng.uniform(0.1, 0.9, (rows, value_heads)).astype(np.float32)
        scale = np.exp2(rng.integers(-spread, spread + 1, (2, value_heads, kd, vd)))
        state0 = (rng.normal(size=(2, value_heads, kd, vd)) * 0.3 * scale).astype(np.float32)
        args = [cuda.to_device(a) for a in (q, k, v)]
        gates = [cuda.to_device(a) for a in (g, beta)]
        for bv in COLUMNS:
            got = []
            for wgmma in (False, True):
                states = cuda.to_device(state0)
                out = delta_mma.delta_mma(args[0], args[1], args[2], 0, gates[0], gates[1], start, 1, states,
                                          walk=(bv, 8), split=SPLIT, wgmma=wgmma)
                got.append((out.copy_to_host(), states.copy_to_host()))
            cuda.synchronize()
            for label, i in (("out", 0), ("state", 1)):
                a, b = got[0][i], got[1][i]
                if a.tobytes() != b.tobytes():
                    differ = int((a.view(np.uint32) != b.view(np.uint32)).sum())
                    return (f"the wgmma walk's {label} differs from the mma.sync walk's in {differ} of {a.size} "
                            f"values (BV {bv}, {rows} rows from {start})")
    return None
