"""A GEMM of our own for short chunks: y = x @ w.T (bf16 in, fp32 accumulate and out) for at
most 64 rows, a numba kernel that calls a CUDA C++ device function (gemm_stream.cu: each CTA
streams its columns' weight rows once through a cp.async pipeline and multiplies every row of
x by them with mma.sync; linked through numba-cuda's `link=`, inlined by link-time
optimisation).

Status: an experiment the backend does not use. On the H200 (bench/gemm_short.py,
bench/RESULTS.md session 13) every variant's rows equal the pinned cuBLASLt algorithm's rows of
an M = 2048 product bit for bit at 9 row counts from 1 to 64 (1, 2, 15, 16, 17, 33, 51, 63, 64),
for the 2B and 27B shapes (the 9B shapes with the first version of the kernel): one fp32
accumulator per output over the k16 products in ascending k is what cuBLASLt's kernels without
split-K compute, so a kernel of ours may replace cuBLASLt (or fuse an epilogue into a product)
without moving a bit. But it is not faster yet: the best variant per shape makes a 27B
forward's products 1.11x cuBLASLt's bucket algorithms at 1 row, 1.22x at 16 and 1.85x at 51
(faster only for kv_proj at 1-16 rows and down_proj at 1 row), so `gemm.Gemm` does not offer
them; bench/gemm_short.py measures them.

Why it was tried (bench/RESULTS.md, session 11): cuBLASLt's best bit-equal algorithms run the
27B shapes at M = 51 at 1.1-5.5x the weight-bandwidth floor (down_proj 75 us against 41.5);
a short chunk's GEMMs are ~60% of its device time. Not available under the CUDA simulator;
tests/executor/numba_cuda/test_gemm_stream_emulated.py runs the source on a host emulator.
"""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import numpy as np
from numba import cuda

from executor.numba_cuda.device import IS_SIMULATOR, check, check_product, device_pointer, empty
from executor.numba_cuda.launch import allow_dynamic_shared, fast

SOURCE = Path(__file__).with_name("gemm_stream.cu")
"""The CUDA C++ source of the device function."""
MAX_ROWS = 64
"""The most rows a call takes (four 16-row m-tiles)."""


MAX_SHARED_BYTES = 227 * 1024
"""The most dynamic shared memory a CTA may ask for on sm_90 (232,448 bytes)."""


def _check_variant(instance, attribute, value) -> None:
    """attrs validator: the source's template constraints (else it would compute wrong columns,
    skip part of K, or fail at launch)."""
    limits = {"warps": (1, 32, 1), "columns_per_warp": (8, 256, 8), "k_tile": (32, 256, 32), "stages": (2, 8, 1)}
    lo, hi, step = limits[attribute.name]
    if not isinstance(value, int) or not lo <= value <= hi or value % step:
        raise ValueError(f"Variant.{attribute.name} must be a multiple of {step} in [{lo}, {hi}], got {value!r}")


@attrs.frozen
class Variant:
    """One compiled shape of the kernel: `warps` warps a CTA (1-32), `columns_per_warp` output
    columns a warp (a multiple of 8: mma n-tiles), K tiles of `k_tile` columns (a multiple of
    32), `stages` tiles in the cp.async pipeline (at least 2). A CTA owns warps *
    columns_per_warp columns and every row. No field changes a bit (each output is one
    accumulator over ascending k). Raises ValueError naming a field outside those limits."""

    warps: int = attrs.field(validator=_check_variant)
    columns_per_warp: int = attrs.field(validator=_check_variant)
    k_tile: int = attrs.field(default=32, validator=_check_variant)
    stages: int = attrs.field(default=4, validator=_check_variant)

    @property
    def columns(self) -> int:
        """Output columns a CTA owns."""
        return self.warps * self.columns_per_warp

    def shared_bytes(self, m_tiles: int) -> int:
        """Dynamic shared memory of a CTA (bytes): `stages` tiles of x (16 * m_tiles rows) and
        w (`columns` rows), each row padded by 8 elements (conflict-free ldmatrix)."""
        return 2 * self.stages * (m_tiles * 16 + self.columns) * (self.k_tile + 8)

    def unfit(self, n: int, k: int) -> str | None:
        """Why the variant does not take an [*, K] x [N, K]^T product (None when it does): N
        must be a positive multiple of 8, K a positive multiple of the K tile, and the shared
        memory at four m-tiles at most MAX_SHARED_BYTES (sm_90's limit)."""
        if n < 8 or n % 8:
            return f"N must be a positive multiple of 8, got {n}"
        if k < self.k_tile or k % self.k_tile:
            return f"K must be a positive multiple of the K tile {self.k_tile}, got {k}"
        if self.shared_bytes(MAX_ROWS // 16) > MAX_SHARED_BYTES:
            return f"{self.shared_bytes(MAX_ROWS // 16)} bytes of shared memory exceed {MAX_SHARED_BYTES}"
        return None

    def fits(self, n: int, k: int) -> bool:
        """Whether the variant takes an [*, K] x [N, K]^T product (`unfit` says why not)."""
        return self.unfit(n, k) is None

    def label(self) -> str:
        """`stream WARPSxCOLUMNS kK_TILE sSTAGES`, as the benchmark tables print it."""
        return f"stream {self.warps}x{self.columns_per_warp} k{self.k_tile} s{self.stages}"


VARIANTS = (
    Variant(4, 16, 32, 4),
    Variant(4, 16, 64, 4),
    Variant(4, 16, 128, 3),
    Variant(4, 8, 128, 4),
    Variant(2, 16, 128, 4),
    Variant(8, 16, 128, 3),
    Variant(8, 32, 64, 3),
)
"""The shapes bench/gemm_short.py checks and times: 32 to 256 columns a CTA, K tiles of 64 to
256 bytes of each weight row, 3 or 4 stages. (The kernel's first version, K tiles of 32 in 48 KB
of static shared memory with rows past M loaded as copies of the last row, ran at 2-5x
cuBLASLt's time: RESULTS.md, session 13.)"""


def unavailable() -> str | None:
    """Why the kernel cannot run here (None when it can)."""
    if IS_SIMULATOR:
        return "the CUDA simulator has no NVRTC or mma"
    return None


@functools.cache
def kernel(variant: Variant, m_tiles: int):
    """(launchable kernel, dynamic shared bytes) of `variant` for up to 16 * m_tiles rows
    (compiled now, its dynamic shared memory allowed). Raises ValueError for m_tiles outside
    [1, 4]."""
    if not 1 <= m_tiles <= MAX_ROWS // 16:
        raise ValueError(f"m_tiles must be in [1, {MAX_ROWS // 16}], got {m_tiles}")
    v = variant
    name = f"gemm_stream_{v.warps}_{v.columns_per_warp}_{m_tiles}_{v.k_tile}_{v.stages}"
    line = f"GEMM_STREAM_ENTRY({v.warps}, {v.columns_per_warp}, {m_tiles}, {v.k_tile}, {v.stages})"
    device_fn = cuda.declare_device(name, "int32(int64, int64, int64, int64, int64, int64)")
    source = cuda.CUSource(SOURCE.read_text() + "\n" + line + "\n", name=f"{name}.cu")

    @cuda.jit("void(int64, int64, int64, int64, int64, int64)", link=[source], lto=True,
              launch_bounds=(v.warps * 32, 1))
    def gemm_stream(x, w, y, m, n, k):
        device_fn(x, w, y, m, n, k)

    nbytes = v.shared_bytes(m_tiles)
    allow_dynamic_shared(gemm_stream, nbytes)
    return fast(gemm_stream), nbytes


def matmul(x, w, variant: Variant, out=None, stream=0):
    """out = x @ w.T (fp32) with `variant`.

    x: uint16 (bf16) numba device array [M, K] with 1 <= M <= MAX_ROWS; w: uint16 [N, K]; both
    C-contiguous and 16-byte aligned; out: None or f32 [M, N], C-contiguous, 8-byte aligned,
    overlapping neither x nor w (CTAs store while others still read); stream: a numba stream
    or 0 (the default stream). Returns out. Raises ValueError naming the argument on a wrong
    dtype, shape, layout or alignment, or an N or K the variant does not take
    (`Variant.unfit`); RuntimeError where the kernel cannot run (`unavailable`).
    """
    m, n, k = check_product(x, w)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows; the streaming GEMM takes 1 to {MAX_ROWS}")
    why = variant.unfit(n, k)
    if why is not None:
        raise ValueError(f"w [{n}, {k}] does not fit {variant.label()}: {why}")
    if out is not None:
        check("out", out, np.float32, 2)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out {out.shape} must be [{m}, {n}]")
    for name, array, align in (("x", x, 16), ("w", w, 16), ("out", out, 8)):
        if array is None:
            continue
        if not array.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous")
        if not IS_SIMULATOR and device_pointer(array) % align:
            raise ValueError(f"{name} must be {align}-byte aligned")
    if IS_SIMULATOR:
        raise RuntimeError(f"streaming GEMM: {unavailable()}")
    out = empty((m, n), np.float32, stream) if out is None else out
    launch, nbytes = kernel(variant, -(-m // 16))
    launch[(-(-n // variant.columns),), variant.warps * 32, stream, nbytes](
        device_pointer(x), device_pointer(w), device_pointer(out), m, n, k)
    return out
