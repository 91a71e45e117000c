"""bf16 GEMMs through cuBLASLt (nvmath-python bindings) on numba device memory, with one
algorithm pinned per (N, K) so a row's bits never depend on the number of rows.

Y[M, N] = X[M, K] @ W[N, K]^T, bf16 inputs, fp32 compute and fp32 output. cuBLAS's
default heuristics pick by M and are not row-invariant for some Qwen3.5 shapes (GPU notes
in DESIGN.md), so `pin` takes the heuristic candidates at a reference M without split-K,
and keeps the first one whose rows at probe row counts equal its rows at the reference M
bit for bit on random data: the reference algorithm, whose bits define every row.

Short chunks: the reference algorithm (tiled for M = 2048) streams the weights at 0.4-2 TB/s
when M is 1 to 256 (27B down_proj: 202 us at M = 16, where another algorithm takes 88 us;
bench/RESULTS.md, session 3). So for each row-count bucket of BUCKETS, `pin` also asks the
heuristic at the bucket's top M, keeps the candidates (no split-K) whose output equals the
reference algorithm's bit for bit at five probe row counts of the bucket, and runs the fastest of
those and the reference itself (timed on the device) for every M in the bucket. Every M past
the buckets (long prefill chunks) likewise runs the fastest bit-equal algorithm timed at
LARGE_ROWS (`_large_algo`). Buckets up to
WIDE_POOL_MAX_ROWS rows also take the candidates the heuristic offers for other shapes
(`pool_queries`): asked at wider N it offers narrower tiles, and an algorithm runs any shape it
accepts (27B down_proj at 51 rows: 83.6 -> 53.2 us, bit-equal; bench/RESULTS.md, session 17). A row's bits
are the reference algorithm's at every M, so chunk invariance holds (a K-reduction order
that matches at one M matches at all: the order depends on the K tiling, not on M; the probes
check it, and the GPU chunk-invariance tests check the whole forward). Twin: ops.linear.
Under the CUDA simulator (no cuBLAS) `matmul` multiplies the host copies in NumPy.

Accumulate (`matmul(..., accumulate=True)`): out += x @ w.T through cuBLASLt's epilogue,
D = alpha (A B) + beta C with alpha = beta = 1 and C = D = out, so a projection writes into the
residual stream: the norm after it reads 6 bytes an element, not 14, and the GEMM reads C
(4 more), so ~18 -> ~14 bytes an element in all (bench/RESULTS.md, session 31). The epilogue
should give fma(1, acc, 1 * c) = round(acc + c), the bits of the separate fp32 add
(`norms.add_rms_norm`'s x += delta); cuBLAS does not document its rounding, so
`accumulates(n, k)` checks it on first use of a shape, for the reference algorithm and each
bucket's at their probe row counts, on random values, values that cancel, subnormals and
infinities (`accumulate_probe_c`).

bf16 output (`matmul(..., bf16=True)`, M past BUCKETS only): D in bf16 from cuBLASLt's epilogue,
for products whose readers round them to bf16 anyway (the backend's in_proj, read by the conv,
the gates and the gated norm, and gate|up, read by SwiGLU): half the bytes written, and the
readers read 2 bytes an element, not 4. `bf16_algo(n, k)` keeps the fastest candidate
(the heuristic's first BUCKET_CANDIDATES at LARGE_ROWS with a bf16 D, no split-K) whose output
equals the round-to-nearest-even bf16 of the reference algorithm's fp32 output bit for bit at
every LARGE_PROBES row count and at LARGE_ROWS (`unequal_rounded`; some rows of x and w scaled
so their products are fp32 subnormals, which an epilogue that flushes them would get wrong), so
a row's bf16 outputs are the rounding of its fp32 ones at every M and the fp32 path (whose
readers round) gives the same bits; and only if it is no slower than the fp32
product of `algo_for(LARGE_ROWS)` at LARGE_ROWS (the GEMM alone: SwiGLU's halved read is then the
gain). None otherwise, and the caller takes the fp32 path. Session 38 (H100, 9B gate_up at
8,192 rows): all 8 bf16 candidates were that rounding; the fastest 2.031 ms against the fp32
path's 2.121 (bench/RESULTS.md).
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import cuda

from executor.numba_cuda.device import (
    IS_SIMULATOR,
    check,
    check_product,
    copy_of,
    device_pointer,
    empty,
    f32_to_bf16,
    to_device,
)
from executor.safetensors_file import bf16_to_f32
from executor.safetensors_file import f32_to_bf16 as host_f32_to_bf16

if not IS_SIMULATOR:
    try:
        from nvmath.bindings import cublasLt as lt
    except ImportError:  # CPU-only installs (no `.[cuda]` extra): creating a handle says so
        lt = None

CUDA_R_16BF = 14
CUDA_R_32F = 0
COMPUTE_32F = 68
OP_N, OP_T = 0, 1
HEURISTIC_BYTES = 96
"""sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, wavesCount, reserved."""
WORKSPACE_BYTES = 32 << 20
REFERENCE_ROWS = 2048
PROBE_ROWS = (1, 7, 16, 64, 100, 129, 333)
CANDIDATES = 16
BUCKETS = ((1, 16), (17, 64), (65, 256), (257, 1024))
"""Row-count ranges [lo, hi] that get their own (bit-identical, fastest) algorithm; larger M
takes the range past them (RANGES, LARGE_ROWS)."""
BUCKET_CANDIDATES = 8
"""Candidates a heuristic query contributes to a bucket (its first ones)."""
WIDE_POOL_MAX_ROWS = 64
"""Buckets whose top M is at most this take the wide pool (`pool_queries`): short chunks, where
the heuristic's own choice at the bucket's M leaves the weight stream at up to 5.7x its floor
(27B kv_proj). Larger buckets ask at their top M only: their probes copy up to 142 MB an
algorithm back to the host (27B gate_up at 1024 rows)."""
POOL_ROWS = (1, 16, 48)
"""Row counts M' the wide pool asks the heuristic at, besides the bucket's top M."""
POOL_COLUMNS = (0.25, 0.5, 1, 2, 3, 4)
"""Multiples of N the wide pool asks the heuristic at. The session 17 search (bench/RESULTS.md)
found each shape's fastest bit-equal algorithm at 51 rows among queries at M' in {1, 16, 48, 51,
64} and N' in {N/2, N, 3N, 4N} (27B down_proj: M' = 51, N' = 3N; kv_proj: 16, 4N)."""
TIMING_REPEATS = 5
TIMING_SPIN_MS = 1.0
"""Device milliseconds of spin ahead of a bucket timing: longer than the host takes to queue
TIMING_REPEATS products."""
TIMING_WEIGHT_BYTES = 256 << 20
"""A bucket timing cycles over copies of the weight that together hold at least this many
bytes (at most TIMING_MAX_COPIES), so a weight the L2 cache (50 MB on the H200) would hold
is read from device memory as in a forward, where every layer has its own weights. Timed
on one L2-resident weight, the 27B kv_proj (21 MB) bucket of 17-64 rows chose an algorithm
that takes 61 us from device memory against the reference's 51 (bench/RESULTS.md,
session 16)."""
TIMING_MAX_COPIES = 16
LARGE_ROWS = 8192
"""Row count at which the range past BUCKETS (M > 1024: long prefill chunks) times its
candidates: the heuristic's first BUCKET_CANDIDATES at (LARGE_ROWS, N) and the reference with
its CTA swizzle flipped (which orders tiles, not sums). The fastest whose rows equal the
reference's bit for bit at LARGE_PROBES runs every M of the range (the reference, unless one
is faster)."""
LARGE_ENV = "WARMSTATE_GEMM_LARGE"
"""Set to 0 to run every M past BUCKETS on the reference algorithm (no search at pinning): the A
side of an A/B; the same bits either way."""
LARGE_PROBES = (1025, 1026, 1537, 2047, REFERENCE_ROWS)
"""Row counts the range past BUCKETS is probed at (rows of the pinning's x, compared with the
reference's on the device)."""
ACCUMULATE_PROBE_ROWS = (1, 51, REFERENCE_ROWS)
"""Row counts at which `accumulates` checks that the reference algorithm's accumulating product
equals out + the product, bit for bit (each bucket's algorithm is checked at its own probe rows)."""


def _ptr(array) -> int:
    return device_pointer(array)


def _stream_ptr(stream) -> int:
    if stream == 0 or stream is None:
        return 0
    handle = stream.handle
    return int(handle.value if hasattr(handle, "value") else handle) or 0


def _set(setter, obj, attr: int, value, dtype) -> None:
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


def timing_copies(weight_bytes: int) -> int:
    """How many copies of a weight of `weight_bytes` a bucket timing cycles over: enough to
    hold TIMING_WEIGHT_BYTES together, 1 to TIMING_MAX_COPIES. Raises ValueError for a
    weight of no bytes."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes must be > 0, got {weight_bytes}")
    return max(1, min(TIMING_MAX_COPIES, -(-TIMING_WEIGHT_BYTES // weight_bytes)))


def pool_queries(n: int, hi: int) -> list[tuple[int, int]]:
    """The (M', N') shapes the wide pool of a bucket with top M `hi` asks the heuristic at, for
    an output width `n`: (hi, n) first, then every M' of POOL_ROWS and hi with every N' =
    multiple x n of POOL_COLUMNS that is a positive multiple of 8, without repeats."""
    out = [(hi, n)]
    for m in sorted({*POOL_ROWS, hi}):
        for multiple in POOL_COLUMNS:
            nq = int(n * multiple)
            if nq >= 8 and nq % 8 == 0 and nq == n * multiple and (m, nq) not in out:
                out.append((m, nq))
    return out


def without_split_k(results: np.ndarray, count: int) -> list[np.ndarray]:
    """The algorithms (64-byte cublasLtMatmulAlgo_t as uint64[8]) of the first `count`
    heuristic results in `results` (HEURISTIC_BYTES each) that succeeded and do not split
    K (a split-K reduction's order depends on the shape)."""
    out = []
    for i in range(count):
        row = results[i * HEURISTIC_BYTES : (i + 1) * HEURISTIC_BYTES]
        if row[72:76].view(np.int32)[0] != 0:  # state != CUBLAS_STATUS_SUCCESS
            continue
        algo = np.array(row[:64].view(np.uint64))
        splitk = np.zeros(1, np.uint32)
        written = np.zeros(1, np.uint64)
        lt.matmul_algo_config_get_attribute(algo.ctypes.data, 2, splitk.ctypes.data, 4, written.ctypes.data)
        if splitk[0] <= 1:
            out.append(algo)
    return out


def random_bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Random bf16 bits (uint16) of `shape`: standard normals truncated to bf16, for the probes."""
    return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bucket_probes(lo: int, hi: int) -> list[int]:
    """The row counts a bucket [lo, hi] is probed at: lo, lo + 1, the middle, hi - 1 and hi,
    those within the bucket, ascending, once each; the range past BUCKETS (hi = LARGE): LARGE_PROBES."""
    if hi == LARGE:
        return list(LARGE_PROBES)
    return sorted({m for m in (lo, lo + 1, (lo + hi) // 2 + 1, hi - 1, hi) if lo <= m <= hi})


LARGE = 1 << 62
"""The top of the last row range, past BUCKETS: every larger M."""
RANGES = (*BUCKETS, (BUCKETS[-1][1] + 1, LARGE))
"""Row-count ranges [lo, hi] that each run one algorithm: BUCKETS, then every M past them."""


@cuda.jit
def _unequal_kernel(a, b, count):
    """count[0] += the number of i with a[i] != b[i] (uint32 words: bits, not values)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    found = 0
    while i < a.size:
        if a[i] != b[i]:
            found += 1
        i += stride
    if found:
        cuda.atomic.add(count, 0, found)


def unequal_words(a, b, max_blocks: int = 1024) -> int:
    """How many 32-bit words of two same-shape C-contiguous f32 device arrays differ (their bits),
    counted on the device by at most `max_blocks` blocks of 256 threads. Raises ValueError when
    the shapes differ."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    count = to_device(np.zeros(1, np.uint32))
    flat_a, flat_b = a.reshape(a.size).view(np.uint32), b.reshape(b.size).view(np.uint32)
    _unequal_kernel[min(max_blocks, max(1, -(-a.size // 256))), 256](flat_a, flat_b, count)
    return int(count.copy_to_host()[0])


@cuda.jit
def _unequal_rounded_kernel(a, b, count):
    """count[0] += the number of i with a[i] != f32_to_bf16(b[i]) (a: bf16 bits, b: f32)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    found = 0
    while i < a.size:
        if a[i] != f32_to_bf16(b[i]):
            found += 1
        i += stride
    if found:
        cuda.atomic.add(count, 0, found)


def unequal_rounded(a, b, max_blocks: int = 1024) -> int:
    """How many elements of a C-contiguous uint16 (bf16) device array differ from the
    round-to-nearest-even bf16 of the same-shape f32 one (`device.f32_to_bf16`), counted on the
    device. Raises ValueError when the shapes differ."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    count = to_device(np.zeros(1, np.uint32))
    _unequal_rounded_kernel[min(max_blocks, max(1, -(-a.size // 256))), 256](a.reshape(a.size), b.reshape(b.size),
                                                                              count)
    return int(count.copy_to_host()[0])


def flip_swizzle(algo: np.ndarray) -> np.ndarray:
    """A copy of a cuBLASLt algorithm (uint64[8]) with its CTA swizzle flipped (0 <-> 1:
    CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, the order tiles are given to CTAs; each output's sum
    is unchanged)."""
    value, written = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
    lt.matmul_algo_config_get_attribute(algo.ctypes.data, 4, value.ctypes.data, 4, written.ctypes.data)
    flipped, flip = algo.copy(), np.array([1 - int(value[0] & 1)], np.uint32)
    lt.matmul_algo_config_set_attribute(flipped.ctypes.data, 4, flip.ctypes.data, 4)
    return flipped


def accumulate_probe_c(rng: np.random.Generator, product: np.ndarray) -> np.ndarray:
    """The C (f32, product's shape [M, N]) that `Gemm._accumulate_failure` adds a product into:
    normals over 24 binary orders; every fifth element the product's negation (an exact +0, which a
    sign-flipped epilogue gives as -0) and every seventh its half; in rows 3, 7, 11, ... (whose
    product is exactly zero: their x rows are zeros) subnormals of either sign, with +inf and -inf
    at every ninth element, so an epilogue that flushes subnormals to zero or drops an infinity
    fails the bit compare."""
    m, n = product.shape
    c = rng.standard_normal((m, n), np.float32) * np.exp2(rng.integers(-12, 12, (m, n)).astype(np.float32))
    flat_c, flat_p = c.reshape(-1), product.reshape(-1)
    flat_c[::5] = -flat_p[::5]
    flat_c[3::7] = flat_p[3::7] * np.float32(0.5)
    zero_rows = c[3::4]
    tiny = rng.integers(1, 1 << 23, zero_rows.shape, dtype=np.uint32)
    tiny |= rng.integers(0, 2, zero_rows.shape, dtype=np.uint32) << np.uint32(31)
    flat = tiny.view(np.float32).reshape(-1)
    flat[::9] = np.inf
    flat[4::9] = -np.inf
    c[3::4] = flat.reshape(zero_rows.shape)
    return c


def accumulate_aligned(out) -> bool:
    """Whether cuBLASLt may add into `out` (a device array, maybe a row slice): its first
    element at a multiple of 256 bytes, cuBLASLt's default alignment, which the pinned
    algorithms were chosen for (always under the simulator, where NumPy adds)."""
    return IS_SIMULATOR or device_pointer(out) % 256 == 0


def refused_before_launch(exc: BaseException) -> bool:
    """Whether a cuBLASLt error is a configuration refusal (CUBLAS_STATUS_NOT_SUPPORTED or
    INVALID_VALUE: nothing ran) rather than one that may come after a launch
    (EXECUTION_FAILED and the rest), judged by the status name in the error's text."""
    text = repr(exc)
    return "NOT_SUPPORTED" in text or "INVALID_VALUE" in text


class Gemm:
    """cuBLASLt handle, workspace and pinned algorithms of one device.

    `matmul(x, w)` computes x @ w.T for bf16 (uint16) device arrays x [M, K], w [N, K]
    (both C-contiguous, 256-byte aligned: fresh allocations) into a new fp32 [M, N] (bf16
    [M, N] with bf16=True, M > 1,024: `bf16_algo`), or
    into (or, accumulating, onto) a given `out`.

    Accumulating relies on no algorithm splitting K: with C == D an in-place split-K
    reduction would read C after a split wrote it. `_candidates` asks for no reduction scheme
    and `without_split_k` drops split-K algorithms; the accumulate check would refuse one too.
    """

    def __init__(self) -> None:
        self.pinned: dict[tuple[int, int], dict] = {}
        self.refused: dict[tuple[int, int, int], str] = {}
        """(M, N, K) -> why its bucket's algorithm refused that M (the reference runs it since)."""
        self._accumulate: dict[tuple[int, int], str] = {}
        """(N, K) -> "" when every algorithm of the shape accumulates bit-exactly, else why not."""
        self.large: bool = os.environ.get(LARGE_ENV, "1").strip() != "0"
        """Whether M past BUCKETS runs `_large_algo`'s choice (else the reference; the same bits).
        Off from the start (LARGE_ENV=0), pinning does not search, and turning it on later
        changes nothing for the buckets. bf16 outputs (`bf16_ready`) follow it at every call:
        none while it is off, whenever it was turned off."""
        self._bf16: dict[tuple[int, int], np.ndarray | None] = {}
        self.refused_bf16: dict[tuple[int, int, int], str] = {}
        """(M, N, K) -> why the bf16 algorithm refused that M (`bf16_ready` says no for it since)."""
        if IS_SIMULATOR:
            return
        if lt is None:
            raise RuntimeError("cuBLASLt needs nvmath-python: pip install -e '.[cuda]'")
        self._handle = lt.create()
        self._workspace = empty((WORKSPACE_BYTES,), np.uint8)
        self._desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)
        _set(lt.matmul_desc_set_attribute, self._desc, 3, OP_T, np.int32)  # TRANSA
        _set(lt.matmul_desc_set_attribute, self._desc, 4, OP_N, np.int32)  # TRANSB
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self._beta_one = np.ones(1, np.float32)
        self._layouts: dict[tuple[int, int, int, int], tuple[int, int, int]] = {}
        self._algos: dict[tuple[int, int], np.ndarray] = {}
        self._buckets: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}

    def _layout(self, m: int, n: int, k: int, d_type: int = CUDA_R_32F) -> tuple[int, int, int]:
        key = (m, n, k, d_type)
        if key not in self._layouts:
            a = lt.matrix_layout_create(CUDA_R_16BF, k, n, k)
            b = lt.matrix_layout_create(CUDA_R_16BF, k, m, k)
            d = lt.matrix_layout_create(d_type, n, m, n)
            self._layouts[key] = (a, b, d)
        return self._layouts[key]

    def _candidates(self, n: int, k: int, m: int = REFERENCE_ROWS, d_type: int = CUDA_R_32F) -> list[np.ndarray]:
        pref = lt.matmul_preference_create()
        try:
            _set(lt.matmul_preference_set_attribute, pref, 1, WORKSPACE_BYTES, np.uint64)  # MAX_WORKSPACE_BYTES
            _set(lt.matmul_preference_set_attribute, pref, 3, 0, np.uint32)  # REDUCTION_SCHEME_MASK: none
            a, b, d = self._layout(m, n, k, d_type)
            results = np.zeros(CANDIDATES * HEURISTIC_BYTES, np.uint8)
            count = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(
                self._handle, self._desc, a, b, d, d, pref, CANDIDATES, results.ctypes.data, count.ctypes.data
            )
        finally:
            lt.matmul_preference_destroy(pref)
        return without_split_k(results, int(count[0]))

    def pool(self, n: int, k: int, hi: int) -> list[np.ndarray]:
        """The candidates a bucket with top M `hi` tries for shape (N, K), without split-K and
        without repeats: the first BUCKET_CANDIDATES the heuristic offers at (hi, N), then, when
        hi <= WIDE_POOL_MAX_ROWS, those it offers at each of `pool_queries(n, hi)`."""
        seen, out = set(), []
        queries = pool_queries(n, hi) if hi <= WIDE_POOL_MAX_ROWS else [(hi, n)]
        for m, nq in queries:
            try:
                found = self._candidates(nq, k, m)[:BUCKET_CANDIDATES]
            except Exception:  # noqa: BLE001 - a shape the heuristic refuses adds nothing
                continue
            for algo in found:
                if algo.tobytes() not in seen:
                    seen.add(algo.tobytes())
                    out.append(algo)
        return out

    def _run(self, algo: np.ndarray, x, w, out, stream=0, accumulate: bool = False) -> None:
        m, k = x.shape
        n = w.shape[0]
        a, b, d = self._layout(m, n, k, CUDA_R_16BF if out.dtype == np.uint16 else CUDA_R_32F)
        beta = self._beta_one if accumulate else self._beta
        lt.matmul(
            self._handle, self._desc, self._alpha.ctypes.data, _ptr(w), a, _ptr(x), b,
            beta.ctypes.data, _ptr(out), d, _ptr(out), d, algo.ctypes.data,
            _ptr(self._workspace), WORKSPACE_BYTES, _stream_ptr(stream),
        )

    def pin(self, n: int, k: int, seed: int = 0) -> np.ndarray:
        """The algorithm used for every M of shape (N, K): the first candidate whose rows
        at PROBE_ROWS equal its rows at REFERENCE_ROWS bit for bit. Raises RuntimeError
        when none does."""
        key = (n, k)
        if key in self._algos:
            return self._algos[key]
        rng = np.random.default_rng(seed)
        w = to_device(random_bf16(rng, (n, k)))
        x = to_device(random_bf16(rng, (REFERENCE_ROWS, k)))
        tried = []
        for index, algo in enumerate(self._candidates(n, k)):
            try:
                full = empty((REFERENCE_ROWS, n), np.float32)
                self._run(algo, x, w, full)
                ref = full.copy_to_host()
                same = True
                for m in PROBE_ROWS:
                    part = empty((m, n), np.float32)
                    xm = to_device(x.copy_to_host()[REFERENCE_ROWS - m :])
                    self._run(algo, xm, w, part)
                    same = same and np.array_equal(part.copy_to_host(), ref[REFERENCE_ROWS - m :])
            except Exception as exc:  # an algorithm that rejects some M is not usable
                tried.append(f"{index}: {exc}")
                continue
            tried.append(f"{index}: {'row-invariant' if same else 'rows differ'}")
            if same:
                self.pinned[key] = {"candidate": index, "algo_id": int(algo[0] & 0xFFFFFFFF), "tried": tried}
                self._buckets[key] = self._bucket_algos(algo, x, w)
                self._algos[key] = algo
                return algo
        raise RuntimeError(f"no row-invariant cuBLASLt algorithm for N={n}, K={k}: {tried}")

    def _seconds(self, algo: np.ndarray, x, weights: list, out) -> float:
        """Device seconds of one product: the mean of max(TIMING_REPEATS, len(weights))
        back-to-back runs cycling over `weights` (copies of one [N, K] weight:
        `timing_copies`) after a warm-up, queued behind a short spin so the host's launch
        cost is not timed."""
        from executor.numba_cuda.device import elapsed_seconds, new_event, spin

        self._run(algo, x, weights[0], out)
        repeats = max(TIMING_REPEATS, len(weights))
        start, stop = new_event(), new_event()
        spin(TIMING_SPIN_MS)
        start.record()
        for i in range(repeats):
            self._run(algo, x, weights[i % len(weights)], out)
        stop.record()
        return elapsed_seconds(start, stop) / repeats

    def _same(self, algo: np.ndarray, x, w, out, expected: np.ndarray) -> bool:
        """Whether `algo`'s product x @ w.T (into out) equals `expected` bit for bit."""
        self._run(algo, x, w, out)
        return np.array_equal(out.copy_to_host(), expected)

    def _bucket_algos(self, reference: np.ndarray, x, w) -> list[tuple[int, np.ndarray]]:
        """[(hi, algo)] per RANGES range: the fastest candidate whose output equals the
        reference algorithm's bit for bit at the range's probe row counts (lo, lo + 1, middle,
        hi - 1, hi; LARGE_PROBES past BUCKETS, `_large_algo`), or the reference itself.
        x: the pinning's random bf16 [REFERENCE_ROWS, K]; w: [N, K]."""
        n, k = w.shape[0], x.shape[1]
        host_x = x.copy_to_host()
        weights = [w] + [copy_of(w) for _ in range(timing_copies(n * k * 2) - 1)]
        chosen, report = [], []
        for lo, hi in BUCKETS:
            probes = bucket_probes(lo, hi)
            inputs = {m: to_device(host_x[:m]) for m in probes}
            outs = {m: empty((m, n), np.float32) for m in probes}
            expected = {}
            for m in probes:
                self._run(reference, inputs[m], w, outs[m])
                expected[m] = outs[m].copy_to_host()
            best, best_s = reference, self._seconds(reference, inputs[hi], weights, outs[hi])
            reference_s, equal = best_s, 0
            candidates = self.pool(n, k, hi)
            for algo in candidates:
                try:
                    if not all(self._same(algo, inputs[m], w, outs[m], expected[m]) for m in reversed(probes)):
                        continue
                    equal += 1
                    seconds = self._seconds(algo, inputs[hi], weights, outs[hi])
                except Exception:  # noqa: BLE001 - an algorithm that rejects this M is not used
                    continue
                if seconds < best_s:
                    best, best_s = algo, seconds
            chosen.append((hi, best))
            report.append({"rows": [lo, hi], "candidates": len(candidates), "bit_equal_candidates": equal, "reference_us": round(reference_s * 1e6, 1),
                           "chosen_us": round(best_s * 1e6, 1), "algo_id": int(best[0] & 0xFFFFFFFF)})
        best, entry = self._large_algo(reference, x, w, weights)
        chosen.append((LARGE, best))
        report.append(entry)
        self.pinned[(n, k)]["buckets"] = report
        return chosen

    def _large_algo(self, reference: np.ndarray, x, w, weights: list) -> tuple[np.ndarray, dict]:
        """The algorithm for every M past BUCKETS, and its report: the fastest at LARGE_ROWS
        rows (the pinning's x repeated) of the reference and the candidates (LARGE_ROWS'
        docstring) whose output equals the reference's bit for bit at every LARGE_PROBES row
        count and at LARGE_ROWS, compared on the device (`unequal_words`; nothing copied to the
        host). Timed at LARGE_ROWS only: the pick also runs chunks of 1025-2047 rows, where it may
        be a little slower than the reference (speed, not bits). Anything that fails on the way (an
        allocation, the reference at LARGE_ROWS) leaves the reference, with the reason in the
        report. x: the pinning's random bf16 device [REFERENCE_ROWS, K]; w: [N, K]."""
        n, k = w.shape[0], x.shape[1]
        entry = {"rows": [BUCKETS[-1][1] + 1, None], "algo_id": int(reference[0] & 0xFFFFFFFF)}
        if not self.large:
            return reference, entry | {"off": f"{LARGE_ENV}=0"}
        began = time.perf_counter()
        try:
            ref_out = empty((REFERENCE_ROWS, n), np.float32)
            self._run(reference, x, w, ref_out)
            out = empty((REFERENCE_ROWS, n), np.float32)
            x_large = to_device(np.tile(x.copy_to_host(), (-(-LARGE_ROWS // REFERENCE_ROWS), 1))[:LARGE_ROWS])
            ref_large, out_large = empty((LARGE_ROWS, n), np.float32), empty((LARGE_ROWS, n), np.float32)
            reference_s = self._seconds(reference, x_large, weights, ref_large)  # leaves its product there
        except Exception as exc:  # noqa: BLE001 - no memory, or the reference refuses LARGE_ROWS
            return reference, entry | {"failed": repr(exc)}
        candidates = []
        try:
            candidates.append(flip_swizzle(reference))
        except Exception:  # noqa: BLE001 - no swizzle to flip: the heuristic's candidates alone
            pass
        try:
            candidates += self._candidates(n, k, LARGE_ROWS)[:BUCKET_CANDIDATES]
        except Exception:  # noqa: BLE001 - a shape the heuristic refuses
            pass
        seen, unique = {reference.tobytes()}, []
        for algo in candidates:
            if algo.tobytes() not in seen:
                seen.add(algo.tobytes())
                unique.append(algo)
        found = self._equal_and_timed(unique, x, w, out, ref_out, x_large, weights, out_large, ref_large, unequal_words)
        best, best_s = reference, reference_s
        for seconds, algo in found:
            if seconds < best_s:
                best, best_s = algo, seconds
        return best, entry | {"timed_at": LARGE_ROWS, "candidates": len(unique), "bit_equal_candidates": len(found),
                              "reference_us": round(reference_s * 1e6, 1), "chosen_us": round(best_s * 1e6, 1),
                              "algo_id": int(best[0] & 0xFFFFFFFF), "search_s": round(time.perf_counter() - began, 3)}

    def _equal_and_timed(self, candidates: list, x, w, out, expected, x_timed, weights: list, out_timed,
                         expected_timed, unequal) -> list[tuple[float, np.ndarray]]:
        """(seconds at x_timed's rows, algo) of each candidate, in order, whose product of x's first
        m rows and w equals expected's first m rows at every m of LARGE_PROBES, and whose timed
        product of x_timed (`_seconds` over `weights`, into out_timed) equals expected_timed;
        equal by `unequal` (a device count of the differing elements: `unequal_words` for an f32
        out, `unequal_rounded` for a bf16 one against f32 expected). A candidate that raises (one
        that rejects these M) is left out."""
        found = []
        for algo in candidates:
            try:
                same = True
                for m in LARGE_PROBES:
                    self._run(algo, x[:m], w, out[:m])
                    same = same and unequal(out[:m], expected[:m]) == 0
                if not same:
                    continue
                seconds = self._seconds(algo, x_timed, weights, out_timed)
                if unequal(out_timed, expected_timed):
                    continue
            except Exception:  # noqa: BLE001 - an algorithm that rejects these M is not used
                continue
            found.append((seconds, algo))
        return found

    def bf16_algo(self, n: int, k: int, seed: int = 0) -> np.ndarray | None:
        """The algorithm `matmul(..., bf16=True)` runs shape (N, K) with, searched once (after
        pinning the shape): of the heuristic's first BUCKET_CANDIDATES at (LARGE_ROWS, N) with a
        bf16 D (no split-K), the fastest at LARGE_ROWS whose output equals the bf16 rounding of
        the reference algorithm's fp32 output bit for bit at every LARGE_PROBES row count and at
        LARGE_ROWS (random bf16 x and w, rows 3, 7, ... of x times 2^-75 and rows 5, 13, ... of w
        times 2^-60, so some outputs are fp32 subnormals; compared on the device:
        `unequal_rounded`), if it is no slower at LARGE_ROWS than the fp32 product of
        `algo_for(LARGE_ROWS, n, k)`. None when none qualifies, when the search cannot run (no
        memory, a refused shape) or when `large` is off (WARMSTATE_GEMM_LARGE=0);
        `pinned[(n, k)]["bf16"]` says which, or what was found. Its scratch (an f32 and a bf16
        [LARGE_ROWS, N], x and a copy of w) comes from the device pool and is freed before it
        returns: callers that measure the pool's peak search first (`activation_peak`)."""
        key = (n, k)
        if key in self._bf16:
            return self._bf16[key]
        reference = self.pin(n, k)
        entry: dict = {}
        self.pinned[key]["bf16"] = entry
        if not self.large:  # not kept: a search runs once `large` is on
            entry["off"] = "Gemm.large is off"
            return None
        self._bf16[key] = None
        began = time.perf_counter()
        try:
            rng = np.random.default_rng(seed)
            host_w, host_x = bf16_to_f32(random_bf16(rng, (n, k))), bf16_to_f32(random_bf16(rng, (LARGE_ROWS, k)))
            host_x[3::4] *= np.float32(2.0**-75)  # exact (powers of two, normal bf16): products near 2^-135
            host_w[5::8] *= np.float32(2.0**-60)
            w, x = to_device(host_f32_to_bf16(host_w)), to_device(host_f32_to_bf16(host_x))
            ref, out = empty((LARGE_ROWS, n), np.float32), empty((LARGE_ROWS, n), np.uint16)
            weights = [w] + [copy_of(w) for _ in range(timing_copies(n * k * 2) - 1)]
            f32_s = self._seconds(self.algo_for(LARGE_ROWS, n, k), x, weights, ref)
            self._run(reference, x, w, ref)  # the reference's bits (the timed algorithm's are the same)
            candidates = self._candidates(n, k, LARGE_ROWS, CUDA_R_16BF)[:BUCKET_CANDIDATES]
        except Exception as exc:  # noqa: BLE001 - no memory, or a shape the heuristic refuses: fp32 path
            entry["failed"] = repr(exc)
            return None
        found = self._equal_and_timed(candidates, x, w, out, ref, x, weights, out, ref, unequal_rounded)
        best, best_s = None, 0.0
        for seconds, algo in found:
            if best is None or seconds < best_s:
                best, best_s = algo, seconds
        entry.update(timed_at=LARGE_ROWS, candidates=len(candidates), bit_equal_candidates=len(found),
                     f32_us=round(f32_s * 1e6, 1), search_s=round(time.perf_counter() - began, 3))
        if best is not None:
            entry.update(fastest_us=round(best_s * 1e6, 1), algo_id=int(best[0] & 0xFFFFFFFF))
            if best_s > f32_s:
                entry["slower_than_f32"] = True
                best = None
        self._bf16[key] = best
        return best

    def bf16_ready(self, m: int, n: int, k: int) -> bool:
        """Whether `matmul(x, w, bf16=True)` may run an [m, K] x [N, K]^T product: `large` on (it
        may change at run time, as bench.decode_prefill's --gemm-large does), M past BUCKETS and
        (on a GPU) a `bf16_algo` for (N, K), searched on the first call for the shape, that has
        not refused this M (`refused_bf16`)."""
        if not self.large or m <= BUCKETS[-1][1] or (m, n, k) in self.refused_bf16:
            return False
        return IS_SIMULATOR or self.bf16_algo(n, k) is not None

    def _accumulate_failure(self, key: tuple[int, int], seed: int = 0) -> str:
        """The empty string when every algorithm that runs (N, K) (the reference at
        ACCUMULATE_PROBE_ROWS, each bucket's at its range's probe row counts lo, lo + 1, middle,
        hi - 1, hi) gives, with beta = 1, out + its product bit for bit (numpy's fp32 add);
        else why not, or why the check could not run (a failed allocation or launch). Random
        bf16 x [M, K] (rows 3, 7, ... zeros) and w; out holds `accumulate_probe_c`: normals over
        24 binary orders, exact cancellations, halves, and subnormals and infinities over the
        zero products. Needs (N, K) pinned."""
        n, k = key
        rng = np.random.default_rng(seed)
        runs = [(m, self._algos[key]) for m in ACCUMULATE_PROBE_ROWS]
        for (lo, hi), (_, algo) in zip(RANGES, self._buckets[key]):
            runs += [(m, algo) for m in bucket_probes(lo, hi)]
        try:
            w = to_device(random_bf16(rng, (n, k)))
            host_x = random_bf16(rng, (max(m for m, _ in runs), k))
        except Exception as exc:  # noqa: BLE001 - no memory for the check: no accumulate
            return f"the check could not run: {exc!r}"
        for m, algo in runs:
            try:
                xs = host_x[:m].copy()
                xs[3::4] = 0  # zero rows: a product of exact zeros, for C's subnormals and infinities
                xm = to_device(xs)
                product = empty((m, n), np.float32)
                self._run(algo, xm, w, product)
                p = product.copy_to_host()
                c = accumulate_probe_c(rng, p)
                out = to_device(c)
                self._run(algo, xm, w, out, accumulate=True)
                got = out.copy_to_host()
            except Exception as exc:  # noqa: BLE001 - an algorithm that refuses beta = 1: no accumulate
                return f"algo {int(algo[0] & 0xFFFFFFFF)} at M={m}: {exc!r}"
            expected = c + p
            if not np.array_equal(got.view(np.uint32), expected.view(np.uint32)):
                bad = int(np.count_nonzero(got.view(np.uint32) != expected.view(np.uint32)))
                return f"algo {int(algo[0] & 0xFFFFFFFF)} at M={m}: {bad} of {got.size} elements differ"
        return ""

    def accumulates(self, n: int, k: int) -> bool:
        """Whether `matmul(..., accumulate=True)` may run shape (N, K): True under the simulator
        (NumPy adds in fp32), else when `_accumulate_failure` found every algorithm of the shape
        bit-equal to out + its product. Pins (N, K) and runs that check on first call for the
        shape (only the output projections ask: the other shapes never pay for it);
        `pinned[(n, k)]["accumulate"]` says "bit-equal" or why not."""
        if IS_SIMULATOR:
            return True
        key = (n, k)
        if key not in self._accumulate:
            self.pin(n, k)
            self._accumulate[key] = self._accumulate_failure(key)
            self.pinned[key]["accumulate"] = self._accumulate[key] or "bit-equal"
        return not self._accumulate[key]

    def algo_for(self, m: int, n: int, k: int) -> np.ndarray:
        """The algorithm that runs an [m, K] x [N, K]^T product (pinning (N, K) on first use):
        its row range's (RANGES), or the reference for an M its range's algorithm refused and
        for M past BUCKETS when `large` is off."""
        reference = self.pin(n, k)
        if (m, n, k) in self.refused or (m > BUCKETS[-1][1] and not self.large):
            return reference
        for hi, algo in self._buckets[(n, k)]:
            if m <= hi:
                return algo
        return reference

    def matmul(self, x, w, out=None, stream=0, accumulate: bool = False, bf16: bool = False):
        """out = x @ w.T (fp32) with the pinned algorithm of (N, K); with accumulate,
        out += x @ w.T, the bits of out + the product in fp32 (see the module docstring); with
        bf16, out = bf16(x @ w.T) (round to nearest even of the fp32 product's bits, by
        `bf16_algo`'s algorithm).

        x: uint16 (bf16) device [M, K]; w: uint16 (bf16) [N, K]; out: None or f32 [M, N]
        (C-contiguous, 256-byte aligned when accumulating: cuBLASLt's default alignment), uint16
        [M, N] C-contiguous with bf16; returns out. Raises ValueError naming `out` when
        accumulate has no out, a wrong one, or a shape that `accumulates` refused; naming `bf16`
        when it comes with accumulate, or for an M, N, K that `bf16_ready` refuses.
        """
        m, n, k = check_product(x, w)
        if bf16:
            return self._matmul_bf16(x, w, out, stream, accumulate, m, n, k)
        if accumulate:
            if out is None:
                raise ValueError("accumulate needs out, the f32 [M, N] array to add into")
            check("out", out, np.float32, 2)
            if tuple(out.shape) != (m, n) or not out.is_c_contiguous():
                raise ValueError(f"out {out.shape} must be a C-contiguous [{m}, {n}] to accumulate into")
            if m and not accumulate_aligned(out):
                raise ValueError("out must be 256-byte aligned to accumulate into")
            if not self.accumulates(n, k):
                raise ValueError(f"out: shape (N={n}, K={k}) does not accumulate exactly: "
                                 f"{self.pinned[(n, k)]['accumulate']}")
        out = empty((m, n), np.float32, stream) if out is None else out
        if m and IS_SIMULATOR:  # the CUDA simulator has no cuBLAS: NumPy on the host copies
            xs, ws = bf16_to_f32(x.copy_to_host()), bf16_to_f32(w.copy_to_host())
            product = (xs.astype(np.float64) @ ws.T.astype(np.float64)).astype(np.float32)
            out.copy_to_device(out.copy_to_host() + product if accumulate else product)
        elif m:
            algo = self.algo_for(m, n, k)
            try:
                self._run(algo, x, w, out, stream, accumulate)
            except Exception as exc:  # a bucket's algorithm that refuses an M its probes missed
                # accumulating, out is C too: only a refusal before any launch may run again
                if algo is self._algos[(n, k)] or (accumulate and not refused_before_launch(exc)):
                    raise
                self.refused[(m, n, k)] = repr(exc)  # the reference gives the same bits at every M
                self._run(self._algos[(n, k)], x, w, out, stream, accumulate)
        return out

    def _matmul_bf16(self, x, w, out, stream, accumulate: bool, m: int, n: int, k: int):
        """`matmul` with bf16 (its checks, then the product)."""
        if accumulate:
            raise ValueError("bf16: an output in bf16 cannot accumulate")
        if not self.bf16_ready(m, n, k):
            if not self.large:
                why = "Gemm.large is off"
            elif m <= BUCKETS[-1][1]:
                why = f"runs M past {BUCKETS[-1][1]} rows only"
            elif (m, n, k) in self.refused_bf16:
                why = f"this M refused the bf16 algorithm: {self.refused_bf16[(m, n, k)]}"
            else:
                why = f"no bf16-output algorithm: {self.pinned[(n, k)]['bf16']}"
            raise ValueError(f"bf16: M={m}, N={n}, K={k}: {why}")
        if out is not None:
            check("out", out, np.uint16, 2)
            if tuple(out.shape) != (m, n) or not out.is_c_contiguous():
                raise ValueError(f"out {out.shape} must be a C-contiguous [{m}, {n}]")
        out = empty((m, n), np.uint16, stream) if out is None else out
        if IS_SIMULATOR:
            xs, ws = bf16_to_f32(x.copy_to_host()), bf16_to_f32(w.copy_to_host())
            out.copy_to_device(host_f32_to_bf16((xs.astype(np.float64) @ ws.T.astype(np.float64)).astype(np.float32)))
        else:
            self._run(self._bf16[(n, k)], x, w, out, stream)
        return out
