"""Prefill attention in one fused pass on the tensor cores: a numba kernel that calls a CUDA
C++ device function (flash_attention.cu: FlashAttention-2's loop with mma.sync bf16
products, cp.async K/V blocks and an online softmax), linked through numba-cuda's `link=`
(NVRTC compiles the source; with nvJitLink, link-time optimisation inlines it).

Same contract as `attention_mm.MatrixAttention.prefill` (rows at positions start,
start + 1, ... of one slot, each against keys [0, its position]; out = bf16 of the
sigmoid-gated attention output) and the same exactness: a row's bits depend only on its
position, head and the cache, never on the chunk, tile or warp it sits in (the source's
header gives the argument). Its bits differ from the matrix path's (online softmax over
32-key blocks instead of one pass over all keys), so a backend picks one path for good.

Numerics against ops.attention: q and P are rounded to bf16, l sums the rounded P, the
products accumulate in fp32. Twins: ops.attention, then ops.sigmoid_gate.
Not available under the CUDA simulator (no NVRTC, no mma): `available` says why.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numba
import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, check, chunk_meta, device_pointer, empty
from executor.numba_cuda.launch import allow_dynamic_shared, fast

SOURCE = Path(__file__).with_name("flash_attention.cu")
"""The CUDA C++ source of the device function."""
BLOCK_KEYS = 32
"""Keys per block (BN in the source): blocks are anchored at key 0."""
WARPS = {16: 4, 32: 4, 64: 4, 128: 8, 256: 8}
"""Warps per CTA for each head_dim (16 virtual rows a warp); the source also instantiates
4 warps at 128 and 256 (`kernel(head_dim, warps, stages)`, for benchmarks)."""
SHORT_VIRTUAL_ROWS = 8192
"""At most this many virtual rows (rows x group) a call, head_dim 256 runs 4 warps a CTA,
above it 8: the same bits (a row never depends on its CTA's other rows; tested), and on
the H200 4 warps were 5-10% faster for short chunks (27B 51 rows at 1984: 265 vs 293 us a
layer) and 8 warps 4% faster for long ones (9B 8192 rows: 3.21 vs 3.35 ms); RESULTS.md,
session 8."""
VARIANTS = {(16, 4, 1), (32, 4, 1), (64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 1, 1), (256, 2, 1), (256, 4, 1),
            (256, 8, 1), (16, 4, 3), (32, 4, 3), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 1, 3), (256, 2, 3),
            (256, 4, 2), (256, 4, 3), (256, 4, 4), (256, 8, 2), (256, 8, 3), (256, 8, 4)}
"""(head_dim, warps, stages) triples flash_attention.cu instantiates. stages 1: one K and one
V block buffer in static shared memory (three barriers a block); stages >= 2: a ring of
`stages` (K, V) block pairs in dynamic shared memory, the next blocks' copies in flight
while a block runs. The same arithmetic in the same order: stages change no bit (tested)."""
STAGES = 3
"""The ring depth `prefill` uses by default. H200, us a call against stages 1 (CUDA events,
.dbg/flashbench.py; bench/RESULTS.md, session 15): 27B 51 rows at 1984, 4 warps: 294 ->
221 (stages 4: 218); 27B 4096 rows at 4096, 8 warps: 3875 -> 3067; 9B 8192 rows at 24576,
8 warps: 20.3 -> 16.0 ms. Four stages of 4 warps (135 KB, one CTA an SM) lose 7-8% on long
chunks."""


def shared_bytes(head_dim: int, stages: int) -> int:
    """Dynamic shared memory of a CTA, bytes: stages x (K block, V block) of BLOCK_KEYS rows
    of head_dim + 8 bf16 (0 for stages 1, whose two buffers are static)."""
    return 0 if stages == 1 else stages * 2 * BLOCK_KEYS * (head_dim + 8) * 2


def unavailable(head_dim: int) -> str | None:
    """Why the fused kernel cannot run here at `head_dim` (None when it can)."""
    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC or mma"
    if head_dim not in WARPS:
        return f"head_dim {head_dim} is not one of {sorted(WARPS)}"
    return None


@functools.cache
def kernel(head_dim: int, warps: int | None = None, stages: int | None = None):
    """(launchable kernel, threads per CTA, dynamic shared bytes) for `head_dim` with `warps`
    warps a CTA (default WARPS[head_dim]) and a ring of `stages` K/V blocks (default STAGES),
    compiled now (its dynamic shared memory allowed). Raises ValueError for a triple the
    source does not instantiate (VARIANTS)."""
    warps = WARPS.get(head_dim) if warps is None else warps
    stages = STAGES if stages is None else stages
    if (head_dim, warps, stages) not in VARIANTS:
        raise ValueError(f"head_dim {head_dim} with {warps} warps and {stages} stages is not one of "
                         f"{sorted(VARIANTS)}")
    device_fn = cuda.declare_device(
        f"flash_prefill_{head_dim}_{warps}_{BLOCK_KEYS}_{stages}",
        "int32(int64, int64, int64, int64, int64, int64, int64, int64, int64, float32)",
    )

    # lto: without nvJitLink the device function would be called through the ABI, not
    # inlined (ptxas: ~600 bytes of spills at head_dim 256), so numba raises here instead
    # and the backend passes over this path (`NumbaCudaBackend.attention_failures`)
    # meta (i32 device: rows in use, start, slot) is read here, so a captured step replays
    # with other values (graphs.PrefillGraphs); a CTA whose tile (the source's
    # gridDim.x - 1 - blockIdx.x) starts past the rows in use returns at once (a padded grid)
    # One signature, compiled now: the dynamic shared memory attribute is set on it.
    @cuda.jit("void(int64, int64, int64, int64, int64, int64, int32[::1], int64, int64, float32)",
              link=[str(SOURCE)], launch_bounds=(warps * 32, max(1, 8 // warps)), lto=True)
    def flash_kernel(q, qg, kc, vc, slot_bytes, out, meta, q_heads, kv_heads, scale):
        rows = numba.int64(meta[0])
        tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
        if tile * (warps * 16) >= rows * (q_heads // kv_heads):
            return
        slot = numba.int64(meta[2]) * slot_bytes
        device_fn(q, qg, kc + slot, vc + slot, out, rows, numba.int64(meta[1]), q_heads, kv_heads, scale)

    nbytes = shared_bytes(head_dim, stages)
    if nbytes > 48 << 10:
        allow_dynamic_shared(flash_kernel, nbytes)
    return fast(flash_kernel), warps * 32, nbytes


def prefill(q, qg, kcache, vcache, slot: int, start: int, out=None, stream=0, warps: int | None = None,
            meta=None, stages: int | None = None):
    """out = bf16(sigmoid_gate(attention(q, K, V), gate)) for rows at positions start,
    start + 1, ... of stream `slot`, each against keys [0, its position].

    q: f32 device [rows, q_heads, head_dim] (after QK-norm and RoPE), C-contiguous, 8-byte
    aligned; qg: f32 [rows, q_heads * 2 * head_dim] (q_proj output; gate halves read),
    C-contiguous, 8-byte aligned; kcache, vcache: uint16 (bf16) [slots, capacity, kv_heads,
    head_dim], C-contiguous, 16-byte aligned (one layer; rows [0, start + rows) written, rows
    up to the next multiple of BLOCK_KEYS finite: the pool zeroes its caches); out: None or
    uint16 [rows, q_heads * head_dim], C-contiguous, 4-byte aligned; stream: a numba
    stream or 0. warps: warps a CTA (default: WARPS[head_dim], 4 at head_dim 256 for at
    most SHORT_VIRTUAL_ROWS virtual rows; benchmarks try the others of VARIANTS); stages:
    the K/V ring's depth (default STAGES; no bit depends on it).
    Returns out. Raises ValueError naming the argument on a wrong shape, dtype, layout or
    alignment, a negative start, rows past the capacity, or a (head_dim, warps, stages) not
    in VARIANTS; RuntimeError where the kernel cannot run (`unavailable`).
    meta: None or i32 device [>= 3] = (rows in use, start, slot), read by the kernel on the
    device (a captured step replays with other values: graphs.PrefillGraphs; rows past
    meta[0] are neither read nor written, and start and slot are checked here only as
    given); None uploads (rows, start, slot). No bit depends on it.
    """
    check("q", q, np.float32, 3)
    check("qg", qg, np.float32, 2)
    check("kcache", kcache, np.uint16, 4)
    check("vcache", vcache, np.uint16, 4)
    rows, q_heads, head_dim = q.shape
    slots, capacity, kv_heads, kd = kcache.shape
    if kd != head_dim or q_heads % kv_heads or tuple(vcache.shape) != tuple(kcache.shape):
        raise ValueError(f"q {q.shape} does not fit the caches {kcache.shape} / {vcache.shape}")
    if tuple(qg.shape) != (rows, q_heads * 2 * head_dim):
        raise ValueError(f"qg {qg.shape} must be [{rows}, {q_heads * 2 * head_dim}]")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if not 0 <= slot < slots or -(-(start + rows) // BLOCK_KEYS) * BLOCK_KEYS > capacity:
        raise ValueError(f"slot {slot} / rows [{start}, {start + rows}) do not fit the capacity {capacity} "
                         f"(keys are read in blocks of {BLOCK_KEYS})")
    if out is not None:
        check("out", out, np.uint16, 2)
        if tuple(out.shape) != (rows, q_heads * head_dim):
            raise ValueError(f"out {out.shape} must be [{rows}, {q_heads * head_dim}]")
    for name, array, align in (("q", q, 8), ("qg", qg, 8), ("kcache", kcache, 16), ("vcache", vcache, 16),
                               ("out", out, 4)):
        if array is None:
            continue
        if not array.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous")
        if array.size and not IS_SIMULATOR and device_pointer(array) % align:
            raise ValueError(f"{name} must be {align}-byte aligned")
    if IS_SIMULATOR:
        raise RuntimeError(f"fused prefill attention: {unavailable(head_dim)}")
    group = q_heads // kv_heads
    if warps is None:
        warps = 4 if head_dim == 256 and rows * group <= SHORT_VIRTUAL_ROWS else WARPS.get(head_dim)
    launch, threads, nbytes = kernel(head_dim, warps, stages)
    out = empty((rows, q_heads * head_dim), np.uint16, stream) if out is None else out
    if not rows:
        return out
    tiles = -(-rows * group // (threads // 32 * 16))
    slot_bytes = capacity * kv_heads * head_dim * 2
    meta = chunk_meta(meta, rows, start, slot, stream)
    launch[(tiles, kv_heads), threads, stream, nbytes](
        device_pointer(q), device_pointer(qg), device_pointer(kcache), device_pointer(vcache), slot_bytes,
        device_pointer(out), meta, q_heads, kv_heads, np.float32(1.0 / np.sqrt(head_dim)),
    )
    return out


def probe(head_dim: int, kv_heads: int = 1, group: int = 2) -> None:
    """Compile and run every variant `prefill` picks at `head_dim` once on a small case
    (3 rows at position 0, keys that make the answer the mean of V's first rows) and check
    the result; raises whatever the compile or launch raises (no NVRTC, no nvJitLink, an
    old GPU), or RuntimeError on a wrong answer."""
    q_heads, rows, capacity = kv_heads * group, 3, BLOCK_KEYS
    q = cuda.to_device(np.zeros((rows, q_heads, head_dim), np.float32))  # equal scores: weights 1/(pos+1)
    qg = cuda.to_device(np.full((rows, q_heads * 2 * head_dim), 40.0, np.float32))  # sigmoid(40) = 1 in f32
    values = np.arange(capacity * kv_heads * head_dim, dtype=np.float32).reshape(1, capacity, kv_heads, head_dim)
    values = (values % 7) - 3
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    kc = cuda.to_device(np.zeros_like(bits))
    vc = cuda.to_device(bits)
    want = np.cumsum(values[0], axis=0)[:rows] / np.arange(1, rows + 1, dtype=np.float32)[:, None, None]
    want = np.repeat(want, group, axis=1)
    for warps in sorted({WARPS.get(head_dim), 4 if head_dim == 256 else WARPS.get(head_dim)}, key=str):
        got = prefill(q, qg, kc, vc, 0, 0, warps=warps).copy_to_host()
        cuda.synchronize()
        got = (got.astype(np.uint32) << 16).view(np.float32).reshape(rows, q_heads, head_dim)
        if not np.allclose(got, want, rtol=1e-2, atol=1e-2):
            raise RuntimeError(f"flash attention probe at head_dim {head_dim}, {warps} warps: max error "
                               f"{np.abs(got - want).max()}")
