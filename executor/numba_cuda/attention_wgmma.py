"""Prefill attention's walk on wgmma (flash_wgmma.cu): the walk of attention_flash.py with its two
products on the H100/H200's warpgroup instructions, every output bit the mma.sync walk's.

numba's `link=` compiles for sm_90, which has no wgmma, so NVRTC compiles flash_attention.cu's
text with flash_wgmma.cu's appended for sm_90a (nvrtc.py) and the driver launches the cubin on
numba's streams and memory. attention_flash.prefill takes this path for a chunk it walks (not
split) at head_dim 256 when `attention_flash.wgmma_status()` is None: the GPU is sm_90, the cubin
builds, and a check of every bit against the mma.sync walk on random inputs passed.
bench/RESULTS.md, session 27: 1.4-1.8x the mma.sync walk on the 9B's 4096-8192-row chunks,
1.7-1.8x and 360-370 TFLOP/s at 8192 rows from 24,576 keys.

Not available under the CUDA simulator (no NVRTC, no wgmma) or without cuda-bindings.
"""

from __future__ import annotations

import functools
from pathlib import Path

SOURCE = Path(__file__).with_name("flash_wgmma.cu")
"""The walk's CUDA C++ (appended to FLASH_SOURCE's)."""
FLASH_SOURCE = Path(__file__).with_name("flash_attention.cu")
"""attention_flash.SOURCE: the mma.sync walk's helpers (softmax, fold, gated write) the walk calls."""
KERNEL = "flash_wgmma_prefill_256"
"""The launchable walk's name in the cubin."""
HEAD_DIM = 256
"""The only head_dim the walk is built for (every Qwen3.5 attention layer's)."""
THREADS = 256
"""Threads a CTA: 8 warps, 2 warpgroups."""
TILE_ROWS = 128
"""Virtual rows a CTA (16 a warp)."""
STAGES = 3
"""(K, V) block pairs in the ring."""
SHARED_BYTES = STAGES * 2 * 32 * HEAD_DIM * 2 + 8 * 16 * HEAD_DIM * 4 + 1024
"""Dynamic shared memory a CTA: the ring (bf16), the 8 warps' running outputs (f32) and 1 KB for
the ring's 1024-byte alignment (the 128-byte swizzle): 230,400 bytes of the 232,448 an SM has."""


def source() -> str:
    """The cubin's CUDA C++: flash_attention.cu, then flash_wgmma.cu with its two wgmma functions."""
    from executor.numba_cuda.nvrtc import wgmma_function

    functions = wgmma_function("wgmma_s", 32, True, False) + wgmma_function("wgmma_o", 256, True, True)
    return FLASH_SOURCE.read_text() + SOURCE.read_text().replace("// @WGMMA_FUNCTIONS@", functions)


def unavailable() -> str | None:
    """Why the walk cannot even be built here (None when it may be: a sm_90 GPU with cuda-bindings)."""
    from executor.numba_cuda.device import IS_SIMULATOR, is_gpu_available

    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC or wgmma"
    if not is_gpu_available():
        return "no CUDA GPU"
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed"
    from numba import cuda

    cc = cuda.get_current_device().compute_capability
    if tuple(cc) != (9, 0):
        return f"wgmma needs compute capability 9.0 (sm_90a), this GPU has {cc[0]}.{cc[1]}"
    return None


@functools.cache
def module():
    """The compiled walk (nvrtc.Module with its dynamic shared memory allowed), built once a
    process. Raises RuntimeError where it cannot be built (`unavailable`, or NVRTC's log)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"wgmma prefill attention: {why}")
    from executor.numba_cuda.nvrtc import Module, compile_cubin

    cubin, _ = compile_cubin(source(), "flash_wgmma.cu")
    built = Module(cubin)
    built.function(KERNEL, SHARED_BYTES)
    return built


def launch(q, qg, kcache, vcache, slot_bytes: int, out, meta, rows: int, q_heads: int, kv_heads: int,
           scale: float, stream=0) -> None:
    """The walk for a chunk of `rows` rows (a grid of its tiles; meta, i32 device [3] = (rows in
    use <= rows, start, slot), is read on the device). Arguments as attention_flash.prefill checks
    them: q f32 [rows, q_heads, 256], qg f32 [rows, q_heads * 512], kcache / vcache uint16 [slots,
    capacity, kv_heads, 256] (slot_bytes = capacity * kv_heads * 512), out uint16 [rows, q_heads *
    256]. Raises RuntimeError where the walk cannot run (`module`) or the launch fails."""
    import numpy as np

    tiles = -(-rows * (q_heads // kv_heads) // TILE_ROWS)
    module().launch(KERNEL, (tiles, kv_heads), THREADS, SHARED_BYTES, q, qg, kcache, vcache, np.int64(slot_bytes),
                    out, meta, q_heads, kv_heads, np.float32(scale), wait=False, stream=stream)
