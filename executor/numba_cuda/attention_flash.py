"""Prefill attention in one fused pass on the tensor cores: a numba kernel that calls a CUDA
C++ device function (flash_attention.cu: FlashAttention-2's loop with mma.sync bf16
products, cp.async K/V blocks and an online softmax), linked through numba-cuda's `link=`
(NVRTC compiles the source; with nvJitLink, link-time optimisation inlines it).

Same contract as `attention_mm.MatrixAttention.prefill` (rows at positions start,
start + 1, ... of one slot, each against keys [0, its position]; out = bf16 of the
sigmoid-gated attention output) and the same exactness: a row's bits depend only on its
position, head and the cache, never on the chunk, tile or warp it sits in (the source's
header gives the argument). Its bits differ from the matrix path's (online softmax over
32-key blocks in 512-key segments, folded, instead of one pass over all keys), so a backend
picks one path for good. A short chunk spreads its key segments over CTAs and folds their
partials in a second kernel (`flash_combine`); a long one folds them in the CTA as it walks:
the same bits (`SPLIT_VIRTUAL_ROWS`).

Numerics against ops.attention: q and P are rounded to bf16, l sums the rounded P, the
products accumulate in fp32. Twins: ops.attention, then ops.sigmoid_gate.
Not available under the CUDA simulator (no NVRTC, no mma): `available` says why.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numba
import numpy as np
from numba import cuda

from executor.numba_cuda import attention_wgmma
from executor.numba_cuda.device import IS_SIMULATOR, check, chunk_meta, device_pointer, empty
from executor.numba_cuda.launch import allow_dynamic_shared, fast

SOURCE = Path(__file__).with_name("flash_attention.cu")
"""The CUDA C++ source of the device functions."""
BLOCK_KEYS = 32
"""Keys per block (BN in the source): blocks are anchored at key 0."""
SEGMENT_BLOCKS = 16
"""Blocks per key segment (SEG_BLOCKS in the source): a row's softmax runs online inside a
segment and the segments are folded in ascending order, in every chunk. 16 since session 38
(8 before): the 9B's wgmma walk 0.93x the time at 8,192 rows from 24,576 (half the folds), a
split of a short chunk half the CTAs (bench/RESULTS.md, session 38)."""
SEGMENT_KEYS = SEGMENT_BLOCKS * BLOCK_KEYS
"""Keys per segment (512): segments are anchored at key 0."""
WARPS = {16: 4, 32: 4, 64: 4, 128: 8, 256: 8}
"""Warps per CTA for each head_dim (16 virtual rows a warp); the source also instantiates
other counts at 128 and 256 (VARIANTS, for benchmarks and tests)."""
SHORT_VIRTUAL_ROWS = 8192
"""At most this many virtual rows (rows x group) a call, head_dim 256 runs 4 warps a CTA,
above it 8: the same bits (a row never depends on its CTA's other rows; tested), and on
the H200 4 warps were 5-10% faster for short chunks (27B 51 rows at 1984: 265 vs 293 us a
layer) and 8 warps 4% faster for long ones (9B 8192 rows: 3.21 vs 3.35 ms); RESULTS.md,
session 8."""
SPLIT_VIRTUAL_ROWS = 512
"""A chunk of at most this many virtual rows (27B: 85 rows; 9B and 2B: 128) splits its key
segments over CTAs (`flash_split`, one segment a CTA, then `flash_combine`): without the
split its few CTAs (27B 51 rows: 20) each walk every key block in turn while most SMs idle
(150 us a layer at 2,035 keys, RESULTS.md session 17). Larger chunks fill the GPU with
tiles and walk their segments in one CTA, folding as they go: the same bits either way."""
SPLIT_GRID_Z = 16
"""CTAs a (tile, K/V head) of a split launched for a captured chunk (`prefill` with meta and
no keys), whose key count is read on the device at each replay: CTA z takes segments z,
z + 16, ... (27B, 51 rows at 1,984 keys: 4 segments, one each). A launch that knows its keys
(an eager chunk) has one CTA a segment."""
SPLIT_SCRATCH_BYTES = 512 << 20
"""Most bytes a split's partials may take (f32 [segments, rows, q_heads, head_dim + 2]);
past it the chunk walks its segments in one CTA (the same bits, 5-9x slower at short
chunks). A captured chunk sizes them for the cache's capacity: 27B, the 64-row bucket at the
server's default 32,768 rows takes 101 MB in the graphs' pool, and past ~173,000 rows of
`--context` its chunks walk."""
MAX_SHARED_BYTES = 232_448
"""Dynamic shared memory a CTA may take on sm_90 (227 KB)."""
VARIANTS = {(16, 4, 3), (32, 4, 3), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 1, 3), (256, 2, 3), (256, 4, 2),
            (256, 4, 3), (256, 4, 4), (256, 8, 2), (256, 8, 3)}
"""(head_dim, warps, stages) triples flash_attention.cu instantiates, each as a chunk's walk
(`flash_prefill`) and a split's (`flash_split`): a ring of `stages` (K, V) block pairs in
dynamic shared memory, the next blocks' copies in flight while a block runs. The same
arithmetic in the same order: neither warps nor stages change a bit (tested). A walk also
keeps its running output in shared memory (16 KB a warp at head_dim 256): 8 warps at
head_dim 256 with a ring of 3 take exactly MAX_SHARED_BYTES."""
STAGES = 3
"""The ring depth `prefill` uses where it fits (`default_stages`). H200, us a call against a
two-buffer kernel (CUDA events, .dbg/flashbench.py; bench/RESULTS.md, session 15): 27B 51
rows at 1984, 4 warps: 294 -> 221; 27B 4096 rows at 4096, 8 warps: 3875 -> 3067; 9B 8192
rows at 24576, 8 warps: 20.3 -> 16.0 ms."""


def shared_bytes(head_dim: int, stages: int, warps: int = 4, split: bool = True) -> int:
    """Dynamic shared memory of a CTA, bytes: stages x (K block, V block) of BLOCK_KEYS rows
    of head_dim + 8 bf16, and for a walk (not split) the warps' running outputs, 16 virtual
    rows x head_dim f32 a warp."""
    ring = stages * 2 * BLOCK_KEYS * (head_dim + 8) * 2
    return ring if split else ring + warps * 16 * head_dim * 4


def default_stages(head_dim: int, warps: int) -> int:
    """STAGES, or the deepest ring below it whose walk fits MAX_SHARED_BYTES."""
    stages = STAGES
    while stages > 2 and shared_bytes(head_dim, stages, warps, split=False) > MAX_SHARED_BYTES:
        stages -= 1
    return stages


def unavailable(head_dim: int) -> str | None:
    """Why the fused kernel cannot run here at `head_dim` (None when it can)."""
    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC or mma"
    if head_dim not in WARPS:
        return f"head_dim {head_dim} is not one of {sorted(WARPS)}"
    return None


@functools.cache
def kernel(head_dim: int, warps: int | None = None, stages: int | None = None, split: bool = False):
    """(launchable kernel, threads per CTA, dynamic shared bytes) for `head_dim` with `warps`
    warps a CTA (default WARPS[head_dim]) and a ring of `stages` K/V blocks (default
    `default_stages`), a walk over every segment or (split) a split's CTA, compiled now (its
    dynamic shared memory allowed). Raises ValueError for a triple the source does not
    instantiate (VARIANTS)."""
    warps = WARPS.get(head_dim) if warps is None else warps
    if stages is None:
        stages = STAGES if warps is None else default_stages(head_dim, warps)
    if (head_dim, warps, stages) not in VARIANTS:
        raise ValueError(f"head_dim {head_dim} with {warps} warps and {stages} stages is not one of "
                         f"{sorted(VARIANTS)}")
    name = "flash_split" if split else "flash_prefill"
    device_fn = cuda.declare_device(
        f"{name}_{head_dim}_{warps}_{BLOCK_KEYS}_{stages}",
        "int32(" + ", ".join(["int64"] * 12) + ", float32)",
    )

    # lto: without nvJitLink the device function would be called through the ABI, not
    # inlined (ptxas: ~600 bytes of spills at head_dim 256), so numba raises here instead
    # and the backend passes over this path (`NumbaCudaBackend.attention_failures`)
    # meta (i32 device: rows in use, start, slot) is read here, so a captured step replays
    # with other values (graphs.PrefillGraphs); a CTA whose tile (the source's
    # gridDim.x - 1 - blockIdx.x) starts past the rows in use returns at once (a padded grid)
    # One signature, compiled now: the dynamic shared memory attribute is set on it.
    @cuda.jit("void(" + ", ".join(["int64"] * 9) + ", int32[::1], int64, int64, float32)",
              link=[str(SOURCE)], launch_bounds=(warps * 32, max(1, 8 // warps)), lto=True)
    def flash_kernel(q, qg, kc, vc, slot_bytes, out, po, pml, pstride, meta, q_heads, kv_heads, scale):
        rows = numba.int64(meta[0])
        tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
        if tile * (warps * 16) >= rows * (q_heads // kv_heads):
            return
        slot = numba.int64(meta[2]) * slot_bytes
        device_fn(q, qg, kc + slot, vc + slot, out, po, pml, pstride, rows, numba.int64(meta[1]), q_heads, kv_heads,
                  scale)

    nbytes = shared_bytes(head_dim, stages, warps, split)
    if nbytes > MAX_SHARED_BYTES:
        raise ValueError(f"head_dim {head_dim} with {warps} warps and {stages} stages takes {nbytes} bytes of shared "
                         f"memory {'split' if split else 'walking'}, more than {MAX_SHARED_BYTES}")
    if nbytes > 48 << 10:
        allow_dynamic_shared(flash_kernel, nbytes)
    return fast(flash_kernel), warps * 32, nbytes


@functools.cache
def combine_kernel(head_dim: int):
    """The launchable fold of a split's partials at `head_dim` (grid: rows, q_heads; head_dim
    // 2 threads), compiled now."""
    device_fn = cuda.declare_device(f"flash_combine_{head_dim}_{BLOCK_KEYS}", "int32(" + ", ".join(["int64"] * 8) + ")")

    @cuda.jit("void(int64, int64, int64, int64, int64, int32[::1], int64)", link=[str(SOURCE)], lto=True)
    def combine(po, pml, qg, out, pstride, meta, q_heads):
        device_fn(po, pml, qg, out, pstride, numba.int64(meta[0]), numba.int64(meta[1]), q_heads)

    return fast(combine)


def split_segments(rows: int, q_heads: int, kv_heads: int, head_dim: int, keys: int) -> int:
    """Key segments a split of `rows` rows must hold partials for when its last row sees
    `keys` keys; 0 when the chunk walks instead (more than SPLIT_VIRTUAL_ROWS virtual rows,
    rows x q_heads // kv_heads; one segment; or partials past SPLIT_SCRATCH_BYTES)."""
    segments = -(-keys // SEGMENT_KEYS)
    nbytes = segments * rows * q_heads * (head_dim + 2) * 4
    if rows * (q_heads // kv_heads) > SPLIT_VIRTUAL_ROWS or segments < 2 or nbytes > SPLIT_SCRATCH_BYTES:
        return 0
    return segments


def prefill(q, qg, kcache, vcache, slot: int, start: int, out=None, stream=0, warps: int | None = None,
            meta=None, stages: int | None = None, split: bool | None = None, keys: int | None = None,
            wgmma: bool | None = None, tma: bool | None = None, lookahead: bool | None = None):
    """out = bf16(sigmoid_gate(attention(q, K, V), gate)) for rows at positions start,
    start + 1, ... of stream `slot`, each against keys [0, its position].

    q: f32 device [rows, q_heads, head_dim] (after QK-norm and RoPE), C-contiguous, 8-byte
    aligned; qg: f32 [rows, q_heads * 2 * head_dim] (q_proj output; gate halves read),
    C-contiguous, 8-byte aligned; kcache, vcache: uint16 (bf16) [slots, capacity, kv_heads,
    head_dim], C-contiguous, 16-byte aligned (one layer; rows [0, start + rows) written, rows
    up to the next multiple of BLOCK_KEYS finite: the pool zeroes its caches); out: None or
    uint16 [rows, q_heads * head_dim], C-contiguous, 4-byte aligned; stream: a numba
    stream or 0. warps: warps a CTA (default: WARPS[head_dim], 4 at head_dim 256 for at
    most SHORT_VIRTUAL_ROWS virtual rows or a split; tests try the others of VARIANTS);
    stages: the K/V ring's depth (default `default_stages`); split: spread the key segments
    over CTAs (default: `split_segments` decides). No bit depends on warps, stages or split.
    Returns out. Raises ValueError naming the argument on a wrong shape, dtype, layout or
    alignment, a negative start, rows past the capacity, or a (head_dim, warps, stages) not
    in VARIANTS; RuntimeError where the kernel cannot run (`unavailable`).
    meta: None or i32 device [>= 3] = (rows in use, start, slot), read by the kernels on the
    device (a captured step replays with other values: graphs.PrefillGraphs; rows past
    meta[0] are neither read nor written, and start and slot are checked here only as
    given); None uploads (rows, start, slot). keys: the most keys a row of this launch sees,
    which sizes a split's partials and its CTAs (at least start + rows, at most the
    capacity); None: start + rows, or with meta the capacity (a captured chunk replays at
    any start: SPLIT_GRID_Z CTAs a tile, each taking every 16th segment). No bit depends on it.
    wgmma: a chunk that walks (not split) at head_dim 256 runs attention_wgmma's walk (the same
    bits, 1.4-1.8x faster on the H200's 4096-8192-row chunks) when True, the mma.sync walk when False, and when None the
    first if `wgmma_status()` is None (warps and stages then do not apply to it); with True a walk
    raises RuntimeError naming why where it cannot run. Split chunks and other head_dims ignore it.
    tma: a wgmma walk copies its K/V blocks by TMA (attention_wgmma.TMA_KERNEL: the same bits) when
    True, by cp.async when False, and when None by TMA if `tma_status()` is None (opt-in:
    WARMSTATE_FLASH_TMA=1). lookahead: a wgmma walk runs in FlashAttention-3's order
    (attention_wgmma.LOOKAHEAD_KERNEL, K/V by cp.async whatever tma says: the same bits) when True,
    not when False, and when None if `lookahead_status()` is None (opt-in:
    WARMSTATE_FLASH_LOOKAHEAD=1).
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
    anywhere = keys is None and meta is not None  # a captured chunk: partials for the capacity's segments
    keys = (capacity if anywhere else start + rows) if keys is None else keys
    if not start + rows <= keys <= capacity:
        raise ValueError(f"keys {keys} must lie in [start + rows, capacity] = [{start + rows}, {capacity}]")
    if IS_SIMULATOR:
        raise RuntimeError(f"fused prefill attention: {unavailable(head_dim)}")
    group = q_heads // kv_heads
    out = empty((rows, q_heads * head_dim), np.uint16, stream) if out is None else out
    if not rows:
        return out
    segments = split_segments(rows, q_heads, kv_heads, head_dim, keys)
    if split is None:
        split = segments > 0
    elif split:
        segments = max(segments, -(-keys // SEGMENT_KEYS))
    slot_bytes = capacity * kv_heads * head_dim * 2
    meta = chunk_meta(meta, rows, start, slot, stream)
    scale = np.float32(1.0 / np.sqrt(head_dim))
    if not split and head_dim == attention_wgmma.HEAD_DIM and wgmma is not False:
        if wgmma or wgmma_status() is None:  # True: attention_wgmma raises where it cannot run
            attention_wgmma.launch(q, qg, kcache, vcache, slot_bytes, out, meta, rows, q_heads, kv_heads, scale,
                                   stream, tma=tma_status() is None if tma is None else tma,
                                   lookahead=lookahead_status() is None if lookahead is None else lookahead)
            return out  # before `kernel`: no mma.sync variant compiled for a chunk that walks on wgmma
    if warps is None:
        warps = 4 if head_dim == 256 and (split or rows * group <= SHORT_VIRTUAL_ROWS) else WARPS.get(head_dim)
    launch, threads, nbytes = kernel(head_dim, warps, stages, split)
    tiles = -(-rows * group // (threads // 32 * 16))
    if not split:
        launch[(tiles, kv_heads), threads, stream, nbytes](
            device_pointer(q), device_pointer(qg), device_pointer(kcache), device_pointer(vcache), slot_bytes,
            device_pointer(out), 0, 0, rows, meta, q_heads, kv_heads, scale)
        return out
    partials = empty((segments, rows, q_heads, head_dim), np.float32, stream)
    ml = empty((segments, rows, q_heads, 2), np.float32, stream)
    launch[(tiles, kv_heads, min(SPLIT_GRID_Z, segments) if anywhere else segments), threads, stream, nbytes](
        device_pointer(q), device_pointer(qg), device_pointer(kcache), device_pointer(vcache), slot_bytes,
        device_pointer(out), device_pointer(partials), device_pointer(ml), rows, meta, q_heads, kv_heads, scale)
    combine_kernel(head_dim)[(rows, q_heads), max(1, head_dim // 2), stream](
        device_pointer(partials), device_pointer(ml), device_pointer(qg), device_pointer(out), rows, meta, q_heads)
    return out


@functools.cache
def wgmma_status() -> str | None:
    """None when `prefill` may walk on wgmma (attention_wgmma) here, else why not: it cannot be
    built (`attention_wgmma.unavailable`, or NVRTC fails), WARMSTATE_FLASH_WGMMA=0 turned it off,
    the check below raised (a launch or copy error: its type and message), or its bits differ from
    the mma.sync walk's on that check, run now (random q, K, V and gates, 4 query heads on 1 K/V
    head, 300 rows from 450 and 96 from 0: masked and unmasked blocks, two segments with a fold
    partway through the walk, a partial
    last tile, slot 1 of 2). Decided once a process, whatever the outcome; it launches and
    synchronizes, so the first prefill calls it before any stream capture."""
    if os.environ.get("WARMSTATE_FLASH_WGMMA", "1").strip() == "0":
        return "turned off by WARMSTATE_FLASH_WGMMA=0"
    why = attention_wgmma.unavailable()
    if why is not None:
        return why
    try:
        attention_wgmma.module()
        return _wgmma_check()
    except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or the check: the mma.sync walk runs
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


TMA_OFF = "off by default (WARMSTATE_FLASH_TMA=1 turns it on; no faster on the H200: bench/RESULTS.md, session 29)"
"""`tma_status` without WARMSTATE_FLASH_TMA=1."""


@functools.cache
def tma_status() -> str | None:
    """None when a wgmma walk copies its K/V blocks by TMA (attention_wgmma.TMA_KERNEL), else why
    not: not asked for (TMA_OFF: WARMSTATE_FLASH_TMA=1 asks), the wgmma walk does not run here
    (`wgmma_status`), TMA cannot (`attention_wgmma.tma_unavailable`), the check raised, or the TMA
    walk's bits differ from the mma.sync walk's on `wgmma_status`'s check. Decided once a process."""
    return _opt_in_walk("WARMSTATE_FLASH_TMA", TMA_OFF, attention_wgmma.tma_unavailable, tma=True)


LOOKAHEAD_OFF = ("off by default (WARMSTATE_FLASH_LOOKAHEAD=1 turns it on; slower than the backend's walk on "
                 "the H200: bench/RESULTS.md, session 35)")
"""`lookahead_status` without WARMSTATE_FLASH_LOOKAHEAD=1."""


@functools.cache
def lookahead_status() -> str | None:
    """None when a wgmma walk runs in FlashAttention-3's order (attention_wgmma.LOOKAHEAD_KERNEL),
    else why not: not asked for (LOOKAHEAD_OFF: WARMSTATE_FLASH_LOOKAHEAD=1 asks), the wgmma walk
    does not run here (`wgmma_status`), the check raised, or the lookahead walk's bits differ from
    the mma.sync walk's on `wgmma_status`'s check. Decided once a process."""
    return _opt_in_walk("WARMSTATE_FLASH_LOOKAHEAD", LOOKAHEAD_OFF, lambda: None, lookahead=True)


def _opt_in_walk(variable: str, off: str, unavailable, **walk) -> str | None:
    """An opt-in wgmma walk's status (`tma_status`, `lookahead_status`): `off` unless `variable` is
    1, else why the walk cannot run (no wgmma walk here, or `unavailable()`), else `_wgmma_check`'s
    verdict on it (`walk`: its tma / lookahead switch), or what that check raised."""
    if os.environ.get(variable, "0").strip() != "1":
        return off
    why = wgmma_status()
    if why is not None:
        return f"no wgmma walk: {why}"
    why = unavailable()
    if why is not None:
        return why
    try:
        return _wgmma_check(**walk)
    except Exception as exc:  # noqa: BLE001 - the driver or the check: the backend's own walk runs
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


def _wgmma_check(tma: bool = False, lookahead: bool = False) -> str | None:
    """`wgmma_status`'s bit check (tma: `tma_status`'s, the TMA walk; lookahead:
    `lookahead_status`'s): None when the wgmma walk gives every bit of the mma.sync walk."""
    rng = np.random.default_rng(27)
    d, q_heads, capacity = attention_wgmma.HEAD_DIM, 4, 1024
    caches = (rng.standard_normal((2, 2, capacity, 1, d)) * 2).astype(np.float32)
    bits = [cuda.to_device((c.view(np.uint32) >> 16).astype(np.uint16)) for c in caches]
    for rows, start in ((300, 450), (96, 0)):  # keys 0-749: two 512-key segments
        q = cuda.to_device((rng.standard_normal((rows, q_heads, d)) * 3).astype(np.float32))
        qg = cuda.to_device(rng.standard_normal((rows, q_heads * 2 * d)).astype(np.float32))
        want = prefill(q, qg, *bits, 1, start, split=False, wgmma=False).copy_to_host()
        got = prefill(q, qg, *bits, 1, start, split=False, wgmma=True, tma=tma, lookahead=lookahead).copy_to_host()
        if (want != got).any():
            kind = " (lookahead)" if lookahead else " (TMA)" if tma else ""
            return (f"the wgmma walk's{kind} bits differ from the mma.sync walk's "
                    f"({int((want != got).sum())} of {want.size} at {rows} rows from {start})")
    return None


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
        for split in (False, True):
            got = prefill(q, qg, kc, vc, 0, 0, warps=warps, split=split).copy_to_host()
            cuda.synchronize()
            got = (got.astype(np.uint32) << 16).view(np.float32).reshape(rows, q_heads, head_dim)
            if not np.allclose(got, want, rtol=1e-2, atol=1e-2):
                raise RuntimeError(f"flash attention probe at head_dim {head_dim}, {warps} warps, split {split}: "
                                   f"max error {np.abs(got - want).max()}")
