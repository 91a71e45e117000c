"""The chunked gated delta rule of a prefill chunk on the tensor cores: two numba kernels that
call CUDA C++ device functions (delta_mma.cu: tf32 mma.sync products, cp.async staging),
linked through numba-cuda's `link=` (NVRTC compiles the source; with nvJitLink, link-time
optimisation inlines it).

Same contract as `delta_chunked.delta_chunked` (one stream's chunk, the state advanced in
place) and the same exactness: 64-row sub-chunks anchored at absolute multiples of 64, each
from its own rows and the incoming fp32 state, so any chunking cut on that grid gives every
row and the state the same bits (the source's header gives the argument). The bits differ
from the CUDA-core path's (tf32 products, another order), so a backend picks one path for good.

Phase 1 (`delta_prepare`, parallel over sub-chunks): W = T (beta e^c k), U = T (beta v),
M = lower_incl((q k^T) e^(c_i - c_j)) and the row factors, into scratch (82 KB per sub-chunk
and value head at key/value dim 128, 2.6x the CUDA-core path's 32 KB: 252 MB for a 4,096-row
27B chunk, the policy's largest by default; 1.35 GB for the 9B shape's 32 value heads over
32,768 rows, 2.0 GB for the 27B's 48; freed blocks stay in the device pool). Phase 2 (`delta_walk`): one CTA per value head and BV state columns walks the
sub-chunks with its state in registers: V' = U - W S, O = e^c (q S) + M V',
S = e^(c_last) S + (k e^(c_last - c))^T V'.

On an H100/H200, phase 2 runs delta_wgmma.py's walk at 64 state columns on 8 warps (the 27B's
shape, where it measured faster): the same products on wgmma, every bit checked equal to this
walk's before first use (`delta_wgmma.status`; WARMSTATE_DELTA_WGMMA=0 turns it off).

Numerics: by default each product is three tf32 products (SPLIT = 3, "3xTF32": ~21 bits of
each operand; within ~2e-6 of the float64 twin, relative to the largest value); SPLIT = 1
rounds the operands to tf32 (10-bit mantissa: ~7e-4). T is an fp32 forward substitution.
Twin: ops.gated_delta_rule_chunked. Not available under the CUDA simulator: `unavailable` says why.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numba
import numpy as np
from numba import cuda

from executor.numba_cuda import delta_wgmma
from executor.numba_cuda.delta_chunked import SUBCHUNK_ROWS, _subchunk_offset, check_chunk_args
from executor.numba_cuda.device import IS_SIMULATOR, check, chunk_meta, device_pointer, empty
from executor.numba_cuda.launch import allow_dynamic_shared, fast

SOURCE = Path(__file__).with_name("delta_mma.cu")
"""The CUDA C++ source of the device functions."""
KEY_DIMS = (16, 32, 64, 128)
"""Key dims (KD) the source is instantiated for (multiples of 16: the state's m-tiles; at most
128 since session 37: phase 1 keeps tf32(k - tf32(k)) in its A and T buffers before the first
head, which hold 64 rows of at most 132 floats, a static_assert in delta_mma.cu)."""
VALUE_DIMS = (8, 16, 32, 64, 128)
"""Value dims (VD) the source is instantiated for (multiples of 8: the mma n-tiles)."""


def _split_from_env() -> int:
    """WARMSTATE_DELTA_SPLIT as 1 or 3 (default 3). Raises ValueError naming the variable."""
    value = os.environ.get("WARMSTATE_DELTA_SPLIT", "3").strip()
    if value not in ("1", "3"):
        raise ValueError(f"WARMSTATE_DELTA_SPLIT must be 1 or 3, got {value!r}")
    return int(value)


SPLIT = _split_from_env()
"""tf32 products per product: 3 (3xTF32, ~fp32 operands: the default) or 1 (plain tf32;
WARMSTATE_DELTA_SPLIT=1). Measured on the H200 (RESULTS.md, session 9): against the float64
twin, outputs and states within ~2e-6 of their largest value with 3 and ~7e-4 with 1; the 9B
shape's 32,768-row chunk 7.5 ms a layer with 3 and 4.0 ms with 1 (12.9 ms on the CUDA
cores). With 1, the whole tiny test models' logits moved 4x further from the reference that
emulates the serving format's bf16 roundings (median 1.2e-2 against 3e-3): a 7e-4 change
flips the bf16 rounding of some out_proj inputs, and the flips carry through the layers. So
3 is the default and 1 a speed option. A backend's states are only bit-comparable within
one value."""
PREPARE_THREADS = 256
SMS = 132
"""Multiprocessors of the H200, the default of `walk_shape` (`multiprocessors()` reads the
device's own count for the launches)."""


def _prepare_floats(kd: int, vd: int) -> int:
    """Dynamic shared floats of phase 1 (PrepareSmem in the source)."""
    c = SUBCHUNK_ROWS
    return c * (kd + 4) + c * (max(kd, vd) + 4) + 2 * c * (c + 4) + 3 * c


def _walk_floats(kd: int, bv: int) -> int:
    """Dynamic shared floats of phase 2 (WalkSmem in the source)."""
    c = SUBCHUNK_ROWS
    return 2 * c * (kd + 4) + c * (kd + 8) + c * (c + 4) + 2 * (kd + c) * (bv + 8) + 2 * c


@functools.cache
def multiprocessors() -> int:
    """The device's multiprocessor count, read once a process (SMS under the simulator or on
    error): a launch heuristic, asked on every call of `delta_mma`."""
    if IS_SIMULATOR:
        return SMS
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001 - a count for a launch heuristic, never an error
        return SMS


def walk_shape(value_dim: int, value_heads: int, sms: int = SMS) -> tuple[int, int]:
    """(BV state columns, warps) of a phase-2 CTA: 32 columns on 8 warps while
    value_dim / 32 * value_heads CTAs fit the multiprocessors in one wave (9B: 128), else 64
    columns on 8 warps (27B: 48 value heads -> 96 CTAs, not 192 in two waves); value_dim
    itself on 4 warps when it is under 32. A step of the walk is a chain of dependent products,
    so 8 warps (two a scheduler) beat 4 (H200, RESULTS.md session 9). The split changes no
    bit (each state element is one mma chain)."""
    if value_dim < 32:
        return value_dim, 4
    if value_dim % 64 == 0 and value_dim // 32 * value_heads > sms:
        return 64, 8
    return 32, 8


def wgmma_walk_status(key_dim: int, value_dim: int, value_heads: int) -> str | None:
    """None when `delta_mma`'s default walk runs on wgmma for a model of these dims and value heads
    (its `walk_shape` on this GPU, split SPLIT), else why not: the shape has no wgmma build, it is
    not one where wgmma measured faster (`delta_wgmma.FASTER`), or `delta_wgmma.status()`'s
    reason. Runs the status check when not yet decided (launches and synchronizes)."""
    bv, warps = walk_shape(value_dim, value_heads, multiprocessors())
    if not delta_wgmma.fits(key_dim, bv, warps, SPLIT):
        return f"no wgmma build for key_dim {key_dim}, walk (BV {bv}, warps {warps}), split {SPLIT}"
    if bv not in delta_wgmma.FASTER:
        return f"{bv} state columns a CTA: mma.sync measured as fast (bench/RESULTS.md, session 40)"
    return delta_wgmma.status()


def prepare_ctas(blocks: int, split: int, sms: int = SMS) -> int:
    """CTAs a multiprocessor phase 1's registers are capped for (its launch bounds) when its
    grid has `blocks` CTAs: 2 with split 1; with split 3, 2 when the grid is more than one
    wave at one CTA a multiprocessor, else 1. At 128 registers the 3xTF32 kernel spilled 64
    bytes a thread (none since session 37's rework; 157 registers uncapped), which cost a lone
    CTA; two CTAs hide each other's barriers and serial forward substitution (H200, RESULTS.md
    session 29: 9B 8,192 rows 0.790 -> 0.570 ms, 27B 4,096 rows 0.550 -> 0.401 ms; 27B 51 rows,
    48 CTAs, 0.026 ms at 1 against 0.029 at 2; after session 37's rework, H100, 9B 32,768 rows:
    2.316 ms at 1 against 1.725 at 2). Either gives the same bits (the same operations; only the
    register allocation differs)."""
    return 2 if split == 1 or blocks > sms else 1


def unavailable(key_dim: int, value_dim: int) -> str | None:
    """Why the tensor-core delta rule cannot run here at these dims (None when it can)."""
    if key_dim not in KEY_DIMS or value_dim not in VALUE_DIMS:
        return f"key_dim {key_dim} / value_dim {value_dim} are not in {KEY_DIMS} / {VALUE_DIMS}"
    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC or mma"
    return None


def _source(line: str, name: str):
    return cuda.CUSource(SOURCE.read_text() + "\n" + line + "\n", name=name)


@functools.cache
def prepare_kernel(kd: int, vd: int, split: int, ctas: int):
    """(launchable phase-1 kernel, dynamic shared bytes) for key dim kd and value dim vd
    (compiled now, dynamic shared memory allowed). ctas: the CTAs a multiprocessor the
    registers are capped for (launch bounds; `prepare_ctas` picks). Two fit at 103 KB of
    shared memory each (dims 128): the loads of one overlap the other's products."""
    name = f"delta_prepare_{kd}_{vd}_{split}"
    fn = cuda.declare_device(name, "int32(" + ", ".join(["int64"] * 16) + ")")

    @cuda.jit("void(" + ", ".join(["int64"] * 9 + ["int32[::1]"] + ["int64"] * 5) + ")",
              link=[_source(f"DELTA_PREPARE({kd}, {vd}, {split})", f"{name}.cu")], lto=True,
              launch_bounds=(PREPARE_THREADS, ctas))
    def delta_prepare(q, k, mixed, g, beta, w, u, m, dv, meta, key_heads, value_heads, channels, v0, per_block):
        rows = numba.int64(meta[0])
        off = numba.int64(meta[1]) % SUBCHUNK_ROWS
        if cuda.blockIdx.x * SUBCHUNK_ROWS >= off + rows:  # past the chunk's last sub-chunk (a padded grid)
            return
        fn(q, k, mixed, g, beta, w, u, m, dv, rows, off, key_heads, value_heads, channels, v0, per_block)

    nbytes = 4 * _prepare_floats(kd, vd)
    allow_dynamic_shared(delta_prepare, nbytes)
    return fast(delta_prepare), nbytes


@functools.cache
def walk_kernel(kd: int, bv: int, warps: int, split: int):
    """(launchable phase-2 kernel, dynamic shared bytes) for key dim kd, BV state columns and
    `warps` warps a CTA (compiled now, dynamic shared memory allowed)."""
    name = f"delta_walk_{kd}_{bv}_{warps}_{split}"
    fn = cuda.declare_device(name, "int32(" + ", ".join(["int64"] * 13) + ")")

    @cuda.jit("void(" + ", ".join(["int64"] * 9 + ["int32[::1]"] + ["int64"] * 3) + ")",
              link=[_source(f"DELTA_WALK({kd}, {bv}, {warps}, {split})", f"{name}.cu")], lto=True,
              launch_bounds=(warps * 32, 1))
    def delta_walk(q, k, w, u, m, dv, states, slot_bytes, out, meta, key_heads, value_heads, value_dim):
        rows = numba.int64(meta[0])
        off = numba.int64(meta[1]) % SUBCHUNK_ROWS
        state = states + numba.int64(meta[2]) * slot_bytes
        fn(q, k, w, u, m, dv, state, out, rows, off, key_heads, value_heads, value_dim)

    nbytes = 4 * _walk_floats(kd, bv)
    allow_dynamic_shared(delta_walk, nbytes)
    return fast(delta_walk), nbytes


def delta_mma(qn, kn, mixed, v0: int, g, beta, start_row: int, slot: int, states, out=None, stream=0,
              per_block: int | None = None, walk: tuple[int, int] | None = None, split: int | None = None,
              meta=None, padded: bool = False, ctas: int | None = None, wgmma: bool | None = None):
    """Run the gated delta rule over one stream's prefill chunk on the tensor cores, advancing
    its state in place; `delta_chunked.delta_chunked`'s arguments and result.

    qn, kn: f32 device [rows, key_heads, key_dim], C-contiguous (qn scaled by key_dim**-0.5);
    mixed: f32 [rows, channels], C-contiguous, v at columns [v0, v0 + value_heads *
    value_dim) with v0 and channels multiples of 4 (16-byte rows); g, beta: f32 [rows,
    value_heads], C-contiguous; states: f32 [slots, value_heads, key_dim, value_dim],
    C-contiguous, the stream's state at states[slot] (absolute rows [start_row, start_row +
    rows)); out: None or f32 [rows, value_heads, value_dim], C-contiguous. Every array 16-byte
    aligned. Returns out. per_block (value heads a phase-1 CTA serves, a divisor of the
    group), walk ((BV, warps) of phase 2), ctas (1 or 2: the CTAs a multiprocessor phase 1's
    registers are capped for, `prepare_ctas`) and split (1 or 3) default to what the call is
    fastest with; per_block, walk and ctas change no bit, split does.
    meta: None or i32 device [>= 3] = (rows in use, start_row, slot), which the kernels read
    on the device (a captured step replays with other values: graphs.PrefillGraphs); None
    uploads (rows, start_row, slot). padded: the launch serves any start row and any
    meta[0] <= rows (phase 1's grid covers the most sub-chunks; the extra CTAs return at
    once); rows past meta[0] are neither read nor written. Neither changes a bit.
    wgmma: phase 2 on wgmma (delta_wgmma.py) or on mma.sync; None (the default) takes wgmma where
    `delta_wgmma.chosen` says (its build fits the walk's shape, it measured faster there, and its
    bits checked equal to the mma.sync walk's on this GPU); True wherever it fits, whatever the
    status (the check's own call; ValueError where it does not fit). The same bits either way.
    Raises ValueError naming the argument on a wrong dtype, shape, layout or alignment, a
    slot or start_row out of range; RuntimeError where the kernels cannot run (`unavailable`).
    """
    rows, key_heads, key_dim, value_heads, value_dim = check_chunk_args(qn, kn, mixed, v0, g, beta, start_row, slot,
                                                                       states)
    channels = mixed.shape[1]
    if key_dim not in KEY_DIMS or value_dim not in VALUE_DIMS:
        raise RuntimeError(f"tensor-core delta rule: {unavailable(key_dim, value_dim)}")
    if v0 % 4 or channels % 4:
        raise ValueError(f"mixed {mixed.shape}: v0 {v0} and its row length must be multiples of 4 (16-byte rows)")
    if out is not None:
        check("out", out, np.float32, 3)
        if tuple(out.shape) != (rows, value_heads, value_dim):
            raise ValueError(f"out {out.shape} must be [{rows}, {value_heads}, {value_dim}]")
    group = value_heads // key_heads
    if per_block is not None and (per_block < 1 or group % per_block):
        raise ValueError(f"per_block {per_block} must divide the group of {group} value heads")
    split = SPLIT if split is None else split
    if split not in (1, 3):
        raise ValueError(f"split must be 1 or 3, got {split}")
    sms = multiprocessors()
    bv, warps = walk_shape(value_dim, value_heads, sms) if walk is None else walk
    if bv < 8 or value_dim % bv or bv % 8 or warps not in (4, 8) or bv // 8 % (warps // 4):
        raise ValueError(f"walk (BV {bv}, warps {warps}) does not split value_dim {value_dim}")
    if ctas not in (None, 1, 2):
        raise ValueError(f"ctas must be 1 or 2, got {ctas}")
    if wgmma and not delta_wgmma.fits(key_dim, bv, warps, split):
        raise ValueError(f"wgmma: no wgmma walk for key_dim {key_dim}, walk (BV {bv}, warps {warps}), split {split}")
    for name, array in (("qn", qn), ("kn", kn), ("mixed", mixed), ("g", g), ("beta", beta), ("states", states),
                        ("out", out)):
        if array is None:
            continue
        if not array.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous")
        if array.size and not IS_SIMULATOR and device_pointer(array) % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    if IS_SIMULATOR:  # after the argument checks, which run under the simulator too
        raise RuntimeError(f"tensor-core delta rule: {unavailable(key_dim, value_dim)}")
    out = empty((rows, value_heads, value_dim), np.float32, stream) if out is None else out
    if not rows:
        return out
    # decided before anything is enqueued: an undecided delta_wgmma.status() runs its check now
    # (it launches and synchronizes), never between phase 1 and phase 2
    on_wgmma = bool(wgmma) or (wgmma is None and delta_wgmma.chosen(key_dim, bv, warps, split))
    meta = chunk_meta(meta, rows, start_row, slot, stream)
    off = SUBCHUNK_ROWS - 1 if padded else _subchunk_offset(start_row)
    subchunks = (off + rows + SUBCHUNK_ROWS - 1) // SUBCHUNK_ROWS
    if per_block is None:  # a key head's whole group when there are enough CTAs, else one head a CTA
        per_block = group if subchunks * key_heads >= sms else 1
    c = SUBCHUNK_ROWS
    sizes = [subchunks * value_heads * c * n for n in (key_dim, value_dim, c, 2)]  # w, u, m, dv (floats)
    scratch = empty(sum(sizes), np.float32, stream)  # one allocation: each part starts 512-byte aligned
    at = device_pointer(scratch)
    parts = []
    for n in sizes:
        parts.append(at)
        at += 4 * n
    ptrs = [device_pointer(a) for a in (qn, kn, mixed, g, beta)] + parts
    grid = (subchunks, key_heads * (group // per_block))
    ctas = prepare_ctas(grid[0] * grid[1], split, sms) if ctas is None else ctas
    prepare, prepare_bytes = prepare_kernel(key_dim, value_dim, split, ctas)
    prepare[grid, PREPARE_THREADS, stream, prepare_bytes](
        *ptrs, meta, key_heads, value_heads, channels, v0, per_block)
    if on_wgmma:
        delta_wgmma.launch(ptrs[0], ptrs[1], ptrs[5], ptrs[6], ptrs[7], ptrs[8], device_pointer(states),
                           value_heads * key_dim * value_dim * 4, device_pointer(out), meta, key_heads, value_heads,
                           value_dim, bv, stream=stream)
        return out
    walk_launch, walk_bytes = walk_kernel(key_dim, bv, warps, split)
    walk_launch[(value_dim // bv, value_heads), warps * 32, stream, walk_bytes](
        ptrs[0], ptrs[1], ptrs[5], ptrs[6], ptrs[7], ptrs[8], device_pointer(states),
        value_heads * key_dim * value_dim * 4, device_pointer(out), meta, key_heads, value_heads, value_dim)
    return out


def probe(key_dim: int, value_dim: int, key_heads: int = 1, group: int = 2) -> None:
    """Compile and run the kernels `delta_mma` uses at these dims and head counts (the phase-2
    shape follows the value heads: give the model's) once on a small case (70 rows from row 30:
    two partial sub-chunks) and compare with the float64 twin; raises whatever the compile or
    launch raises (no NVRTC, no nvJitLink, an old GPU, too little shared memory for the shape),
    or RuntimeError on a wrong answer."""
    from executor.reference import ops

    r = np.random.default_rng(0)
    rows, value_heads = 70, key_heads * group
    q = ops.l2_normalize(r.normal(size=(rows, key_heads, key_dim))).astype(np.float32)
    k = ops.l2_normalize(r.normal(size=(rows, key_heads, key_dim))).astype(np.float32)
    v = r.normal(size=(rows, value_heads, value_dim)).astype(np.float32)
    g = -r.uniform(0.01, 0.5, (rows, value_heads)).astype(np.float32)
    beta = r.uniform(0.1, 0.9, (rows, value_heads)).astype(np.float32)
    state0 = (r.normal(size=(1, value_heads, key_dim, value_dim)) * 0.3).astype(np.float32)
    want, want_state = ops.gated_delta_rule_chunked(q, k, v, g, beta, state0[0], 30)
    states = cuda.to_device(state0)
    qn = (q * np.float32(key_dim**-0.5)).astype(np.float32)
    prepare_kernel(key_dim, value_dim, SPLIT, 2)  # compiled now: the build long chunks launch (prepare_ctas)
    # the wgmma walk's check, where the model's walk would take it: decided now, before any stream
    # capture (it launches and synchronizes)
    wgmma_walk_status(key_dim, value_dim, value_heads)
    got = delta_mma(cuda.to_device(qn), cuda.to_device(k), cuda.to_device(v.reshape(rows, -1)), 0,
                    cuda.to_device(g), cuda.to_device(beta), 30, 0, states).copy_to_host()
    cuda.synchronize()
    for label, a, b in (("out", got, want), ("state", states.copy_to_host()[0], want_state)):
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        if not np.isfinite(a).all() or err > 1e-2:
            raise RuntimeError(f"tensor-core delta rule probe at key_dim {key_dim}, value_dim {value_dim}: {label} "
                               f"max error {err:.3g} of the largest value")
