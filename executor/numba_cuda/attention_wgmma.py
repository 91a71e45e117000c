"""Prefill attention's walk on wgmma (flash_wgmma.cu): the walk of attention_flash.py with its two
products on the H100/H200's warpgroup instructions, every output bit the mma.sync walk's.

numba's `link=` compiles for sm_90, which has no wgmma, so NVRTC compiles flash_attention.cu's
text with flash_wgmma.cu's appended for sm_90a (nvrtc.py) and the driver launches the cubin on
numba's streams and memory. attention_flash.prefill takes this path for a chunk it walks (not
split) at head_dim 256 when `attention_flash.wgmma_status()` is None: the GPU is sm_90, the cubin
builds, and a check of every bit against the mma.sync walk on random inputs passed.
bench/RESULTS.md, session 27: 1.4-1.8x the mma.sync walk on the 9B's 4096-8192-row chunks,
1.7-1.8x and 360-370 TFLOP/s at 8192 rows from 24,576 keys.

Three launchable walks: KERNEL copies each (K, V) block with cp.async, 8 copies of 16 bytes a
thread; TMA_KERNEL has one thread copy it by TMA (4 boxes of 64 dims x 32 keys each for K and V,
through `tensor_map`s of the caches) against an mbarrier per ring stage. The same products in the
same order: the same bits. TMA is opt-in (WARMSTATE_FLASH_TMA=1; attention_flash.tma_status checks
its bits before first use): on the H200 it ran 0.97-0.98x of the cp.async walk at the 9B's
8192-row chunks from 16,384 and 24,576 keys and 1.0x from 0 (bench/RESULTS.md, session 29): the
copies were not what bounds the walk. LOOKAHEAD_KERNEL is KERNEL's walk in FlashAttention-3's
order (the tensor cores run the next block's S and this block's P V while the warps work out the
next block's softmax; KERNEL waits for each S before its softmax, so the two alternate): opt-in
too (WARMSTATE_FLASH_LOOKAHEAD=1, attention_flash.lookahead_status): on the H200 it gives KERNEL's
bits and is slower (0.92x at the 9B's 8192-row chunk from 24,576 keys; bench/RESULTS.md, session 35).

Not available under the CUDA simulator (no NVRTC, no wgmma) or without cuda-bindings.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("flash_wgmma.cu")
"""The walk's CUDA C++ (appended to FLASH_SOURCE's)."""
WGMMA_SOURCE = Path(__file__).with_name("wgmma.cu")
"""The wgmma helpers (wg_fence, wg_commit, wg_wait0, wg_keep, wg_proxy_fence, wg_desc) both walks share."""
FLASH_SOURCE = Path(__file__).with_name("flash_attention.cu")
"""attention_flash.SOURCE: the mma.sync walk's helpers (softmax, fold, gated write) the walk calls."""
KERNEL = "flash_wgmma_prefill_256"
"""The launchable walk's name in the cubin (K/V blocks by cp.async)."""
TMA_KERNEL = "flash_wgmma_tma_prefill_256"
"""The launchable walk with its K/V blocks by TMA."""
LOOKAHEAD_KERNEL = "flash_wgmma_lookahead_prefill_256"
"""The launchable walk in FlashAttention-3's intra-warpgroup order (`lookahead_walk` in the source:
S of the next key block and P V of this one on the tensor cores while the warps work out the next
block's probabilities; one CTA barrier a block): the same products and softmax in the same order,
so the same bits. Opt-in (attention_flash.lookahead_status): slower than KERNEL on the H200 (session 35)."""
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
TMA_SHARED_BYTES = SHARED_BYTES + 64
"""TMA_KERNEL's: SHARED_BYTES and the ring's STAGES mbarriers (8 bytes each)."""
LOOKAHEAD_SHARED_BYTES = SHARED_BYTES + 8 * 16 * 2 * 4
"""LOOKAHEAD_KERNEL's: SHARED_BYTES and the 8 warps' running (M, L) of their 16 rows (f32), kept out of
its registers: 231,424 bytes of the 232,448 an SM has."""
BOX_KEYS = 32
"""Keys a TMA box (a K/V block: flash_attention.cu's BN)."""


def source() -> str:
    """The cubin's CUDA C++: flash_attention.cu, wgmma.cu, then flash_wgmma.cu with its two wgmma functions."""
    from executor.numba_cuda.nvrtc import wgmma_function

    functions = wgmma_function("wgmma_s", 32, True, False) + wgmma_function("wgmma_o", 256, True, True)
    return (FLASH_SOURCE.read_text() + WGMMA_SOURCE.read_text()
            + SOURCE.read_text().replace("// @WGMMA_FUNCTIONS@", functions))


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
    built.function(TMA_KERNEL, TMA_SHARED_BYTES)
    built.function(LOOKAHEAD_KERNEL, LOOKAHEAD_SHARED_BYTES)
    return built


def tma_unavailable() -> str | None:
    """Why TMA_KERNEL cannot run here (None when it may): `unavailable`, or a cuda-bindings without
    cuTensorMapEncodeTiled."""
    why = unavailable()
    if why is not None:
        return why
    from cuda.bindings import driver

    if not hasattr(driver, "cuTensorMapEncodeTiled"):
        return "cuda-bindings has no cuTensorMapEncodeTiled"
    return None


def tensor_map(cache):
    """The TMA descriptor (a cuda.bindings CUtensorMap) of one layer's K or V cache, uint16 (bf16)
    [slots, capacity, kv_heads, 256], C-contiguous, 16-byte aligned: a 3-d bf16 tensor (256 dims,
    kv_heads, slots x capacity rows; strides 512 and kv_heads x 512 bytes), boxes of 64 dims x 1
    head x BOX_KEYS rows written in the 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B: piece p of a
    box row r at (p ^ (r % 8)) * 16, the layout the walk's descriptors read; CUDA driver API,
    cuTensorMapEncodeTiled). Rows past the tensor read as zeros. Built once per (address, shape).
    Raises ValueError naming what does not fit, RuntimeError when the driver refuses it."""
    shape = tuple(cache.shape)
    if cache.dtype != np.uint16 or len(shape) != 4 or shape[3] != HEAD_DIM:
        raise ValueError(f"cache {cache.dtype} {shape} must be uint16 [slots, capacity, kv_heads, {HEAD_DIM}]")
    if not cache.is_c_contiguous():
        raise ValueError("cache must be C-contiguous")
    address = cache.__cuda_array_interface__["data"][0]
    if address % 16:
        raise ValueError(f"cache at {address:#x} must be 16-byte aligned")
    return _tensor_map(address, shape[0] * shape[1], shape[2])


@functools.lru_cache(maxsize=512)
def _tensor_map(address: int, rows: int, kv_heads: int):
    from cuda.bindings import driver

    from executor.numba_cuda.nvrtc import check

    if not hasattr(driver, "cuTensorMapEncodeTiled"):
        raise RuntimeError("TMA walk: cuda-bindings has no cuTensorMapEncodeTiled")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # its lists take these, not ints
    return check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, address,
        [u64(HEAD_DIM), u64(kv_heads), u64(rows)], [u64(HEAD_DIM * 2), u64(kv_heads * HEAD_DIM * 2)],
        [u32(64), u32(1), u32(BOX_KEYS)], [u32(1), u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))


def launch(q, qg, kcache, vcache, slot_bytes: int, out, meta, rows: int, q_heads: int, kv_heads: int,
           scale: float, stream=0, tma: bool = False, lookahead: bool = False) -> None:
    """The walk for a chunk of `rows` rows (a grid of its tiles; meta, i32 device [3] = (rows in
    use <= rows, start, slot), is read on the device). Arguments as attention_flash.prefill checks
    them: q f32 [rows, q_heads, 256], qg f32 [rows, q_heads * 512], kcache / vcache uint16 [slots,
    capacity, kv_heads, 256] (slot_bytes = capacity * kv_heads * 512), out uint16 [rows, q_heads *
    256]. tma: TMA_KERNEL (the caches through `tensor_map`) instead of KERNEL; lookahead:
    LOOKAHEAD_KERNEL (K/V by cp.async; it wins over tma); the same bits from all three.
    Raises RuntimeError where the walk cannot run (`module`, `tensor_map`) or the launch fails."""
    tiles = -(-rows * (q_heads // kv_heads) // TILE_ROWS)
    if lookahead:
        module().launch(LOOKAHEAD_KERNEL, (tiles, kv_heads), THREADS, LOOKAHEAD_SHARED_BYTES, q, qg, kcache, vcache,
                        np.int64(slot_bytes), out, meta, q_heads, kv_heads, np.float32(scale), wait=False,
                        stream=stream)
        return
    if tma:
        module().launch(TMA_KERNEL, (tiles, kv_heads), THREADS, TMA_SHARED_BYTES, tensor_map(kcache),
                        tensor_map(vcache), q, qg, int(kcache.shape[1]), out, meta, q_heads, kv_heads,
                        np.float32(scale), wait=False, stream=stream)
        return
    module().launch(KERNEL, (tiles, kv_heads), THREADS, SHARED_BYTES, q, qg, kcache, vcache, np.int64(slot_bytes),
                    out, meta, q_heads, kv_heads, np.float32(scale), wait=False, stream=stream)
