"""Prefill attention on the tensor cores: for each K/V head, S = Q K^T / sqrt(head_dim) and
O = P V run as strided-batched bf16 cuBLASLt GEMMs (fp32 accumulate and output), with the
causal mask, the softmax and the sigmoid output gate in numba kernels.

One stream's prefill rows [start, start + rows) attend to keys [0, position] of that
stream's K/V cache. Query rows go in tiles of consecutive rows; a tile [a, b) needs only
keys [0, start + b), so whole key ranges past a tile's last row are never computed (the
causal skip at tile granularity). Per tile and K/V head h (group g = q_heads / kv_heads):

    Q_h   bf16 [tile * g, head_dim]      row i * g + j = query row i, query head h * g + j
    S_h   f32  [tile * g, keys]          = scale * Q_h K_h^T          (cuBLASLt, batch kv_heads)
    P_h   bf16 [tile * g, keys]          = bf16(exp(S - rowmax)) masked to keys <= position
    O_h   f32  [tile * g, head_dim]      = P_h V_h                    (cuBLASLt, batch kv_heads)
    out        [rows, q_heads * head_dim] = bf16((O / sum(P)) * sigmoid(gate))

Exactness (chunk invariance, DESIGN "invariant grid"): one algorithm per GEMM kind is
pinned (no split-K) and probed so that an element of S does not depend on the row count
or the key count of the product, and an element of O does not depend on the row count or
on trailing keys whose P is zero (keys are anchored at row 0, so a row's products and
their order are the same whatever chunk or tile it sits in). The row max and sum use a
fixed per-thread stride and tree order over the row's own keys. So a query row's output
bits depend only on its position and the cache, never on the chunk, tile or tail.
`pin` raises RuntimeError when no candidate passes; the backend then keeps the CUDA-core
kernel of attention.py.

Numerics against ops.attention: q and P are rounded to bf16 (as in FlashAttention), the
sum is taken over the rounded P, so a row's weights sum to one exactly as used.
Under the CUDA simulator the two GEMMs run in NumPy (float64, rounded to float32).
Twins: ops.attention, then ops.sigmoid_gate.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from executor.numba_cuda.device import (
    IS_SIMULATOR,
    bf16_to_f32,
    check,
    empty,
    f32_to_bf16,
)
from executor.numba_cuda.gemm import (
    COMPUTE_32F,
    CUDA_R_16BF,
    CUDA_R_32F,
    HEURISTIC_BYTES,
    OP_N,
    OP_T,
    WORKSPACE_BYTES,
    _ptr,
    _set,
    _stream_ptr,
    without_split_k,
)
from executor.numba_cuda.launch import fast
from executor.safetensors_file import bf16_to_f32 as host_bf16_to_f32

if not IS_SIMULATOR:
    try:
        from nvmath.bindings import cublasLt as lt
    except ImportError:  # CPU-only installs (no `.[cuda]` extra): creating a handle says so
        lt = None

ROW_THREADS = 8 if IS_SIMULATOR else 256
"""Threads per softmax row block (keys t, t + ROW_THREADS, ... per thread, then a tree);
fewer under the simulator, where every thread is a Python thread."""
TILE_BYTES = 1 << 31
"""Scratch bytes for one query tile's S (f32) and P (bf16): sets the tile's rows."""
KEY_ALIGN = 256
"""Both GEMMs run over the key count rounded up to a multiple of this (whole K tiles; see
MatrixAttention); S and P rows have that many columns."""
CANDIDATES = 16
_F32 = np.float32
_NEG_INF = _F32(-np.inf)


def padded(keys: int) -> int:
    """`keys` rounded up to a multiple of KEY_ALIGN."""
    return -(-keys // KEY_ALIGN) * KEY_ALIGN


def tile_rows(rows: int, heads: int, keys: int, budget: int = TILE_BYTES) -> int:
    """Query rows per tile: as many as fit `budget` bytes of S and P for `heads` query heads
    against `keys` keys (a multiple of 64, at least 64), at most `rows`."""
    fit = budget // (heads * padded(keys) * 6)
    return max(1, min(rows, max(64, fit // 64 * 64)))


# numba kernels ----------------------------------------------------------------------------


@fast
@cuda.jit
def _pack_kernel(q, lo, group, qb):
    # q: [rows, q_heads, head_dim] f32; qb: [kv_heads, tile * group, head_dim] bf16
    i = cuda.blockIdx.x
    head = cuda.blockIdx.y
    h = head // group
    r = i * group + head % group
    for d in range(cuda.threadIdx.x, q.shape[2], cuda.blockDim.x):
        qb[h, r, d] = f32_to_bf16(q[lo + i, head, d])


@fast
@cuda.jit
def _softmax_kernel(s, first_pos, group, keys, p, sums):
    # s: [kv_heads, tile * group, padded] f32; p: same shape, bf16; sums: [kv_heads, tile * group] f32
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    t = cuda.threadIdx.x
    pos = first_pos + r // group
    red = cuda.shared.array(ROW_THREADS, np.float32)
    top = _NEG_INF
    for k in range(t, pos + 1, ROW_THREADS):
        top = max(top, s[h, r, k])
    red[t] = top
    cuda.syncthreads()
    step = ROW_THREADS // 2
    while step > 0:
        if t < step and red[t + step] > red[t]:
            red[t] = red[t + step]
        cuda.syncthreads()
        step //= 2
    top = red[0]
    cuda.syncthreads()
    total = _F32(0.0)
    for k in range(t, keys, ROW_THREADS):
        e = np.uint16(0)
        if k <= pos:
            e = f32_to_bf16(math.exp(s[h, r, k] - top))
            total += bf16_to_f32(e)
        p[h, r, k] = e
    red[t] = total
    cuda.syncthreads()
    step = ROW_THREADS // 2
    while step > 0:
        if t < step:
            red[t] += red[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        sums[h, r] = red[0]


@fast
@cuda.jit
def _finish_kernel(o, sums, qg, lo, group, out):
    # o: [kv_heads, tile * group, head_dim] f32; qg: [rows, q_heads * 2 * head_dim] f32
    # out: [rows, q_heads * head_dim] bf16
    i = cuda.blockIdx.x
    head = cuda.blockIdx.y
    h = head // group
    r = i * group + head % group
    head_dim = o.shape[2]
    total = sums[h, r]
    for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
        gate = qg[lo + i, head * 2 * head_dim + head_dim + d]
        out[lo + i, head * head_dim + d] = f32_to_bf16((o[h, r, d] / total) / (_F32(1.0) + math.exp(-gate)))


# cuBLASLt ---------------------------------------------------------------------------------


def _bits(rng, shape, lo=None):
    x = rng.standard_normal(shape, np.float32) if lo is None else rng.uniform(lo, 1.0, shape).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


class MatrixAttention:
    """cuBLASLt handle, workspace, pinned algorithms and tile scratch of one device.

    `prefill(q, qg, kcache, vcache, slot, start)` is the entry point; calls must be
    serialised on one stream (the tile scratch is reused across calls, grow-only).
    Both GEMMs run over `padded(keys)` keys (a multiple of KEY_ALIGN): whole K tiles, so a
    product's k-loop has the same tiles from key 0 whatever the key count (kernels that
    take a ragged K tile first would otherwise shift the grouping); the cache rows past a
    chunk are finite (the pool zeroes its K/V at start) and their P is zero.
    Layout variants, tried in this order when pinning: "batched" (one strided-batched call
    over the K/V heads) and "per-head" (one call per K/V head).
    """

    QK, PV = "qk", "pv"
    VARIANTS = ("batched", "per-head")

    def __init__(self) -> None:
        self.pinned: dict[tuple[str, int], dict] = {}
        self.failure: str | None = None
        """Why `ready` said no (None when it has not, or said yes)."""
        self._algos: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
        self._scratch: dict[str, object] = {}
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        if IS_SIMULATOR:
            return
        if lt is None:
            raise RuntimeError("cuBLASLt needs nvmath-python: pip install -e '.[cuda]'")
        self._handle = lt.create()
        self._workspace = empty((WORKSPACE_BYTES,), np.uint8)
        self._descs = {}
        for kind, trans_a in ((self.QK, OP_T), (self.PV, OP_N)):
            desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)
            _set(lt.matmul_desc_set_attribute, desc, 3, trans_a, np.int32)  # TRANSA
            _set(lt.matmul_desc_set_attribute, desc, 4, OP_N, np.int32)  # TRANSB
            self._descs[kind] = desc
        self._layouts: dict[tuple, int] = {}

    # layouts: column-major cuBLAS views of row-major arrays, batched over K/V heads
    def _layout(self, dtype: int, rows: int, cols: int, ld: int, batch: int, stride: int) -> int:
        key = (dtype, rows, cols, ld, batch, stride)
        if key not in self._layouts:
            layout = lt.matrix_layout_create(dtype, rows, cols, ld)
            if batch > 1:
                _set(lt.matrix_layout_set_attribute, layout, int(lt.MatrixLayoutAttribute.BATCH_COUNT), batch,
                     np.int32)
                _set(lt.matrix_layout_set_attribute, layout, int(lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET),
                     stride, np.int64)
            self._layouts[key] = layout
        return self._layouts[key]

    def _shapes(self, kind: str, m: int, keys: int, ld_s: int, head_dim: int, batch: int, ld_kv: int):
        """(A, B, D) layouts and the (A, B, D) byte strides between heads. QK: S^T[keys, m]
        = op(K)[keys, d] . Q^T[d, m]; PV: O^T[d, m] = V^T[d, keys] . P^T[keys, m]."""
        if kind == self.QK:
            strides = (2 * head_dim, 2 * m * head_dim, 4 * m * ld_s)
            a = self._layout(CUDA_R_16BF, head_dim, keys, ld_kv, batch, head_dim)
            b = self._layout(CUDA_R_16BF, head_dim, m, head_dim, batch, m * head_dim)
            d = self._layout(CUDA_R_32F, keys, m, ld_s, batch, m * ld_s)
        else:
            strides = (2 * head_dim, 2 * m * ld_s, 4 * m * head_dim)
            a = self._layout(CUDA_R_16BF, head_dim, keys, ld_kv, batch, head_dim)
            b = self._layout(CUDA_R_16BF, keys, m, ld_s, batch, m * ld_s)
            d = self._layout(CUDA_R_32F, head_dim, m, head_dim, batch, m * head_dim)
        return (a, b, d), strides

    def _run(self, kind: str, variant: str, algo, kv_ptr: int, x_ptr: int, out_ptr: int, m: int, keys: int,
             ld_s: int, head_dim: int, kv_heads: int, ld_kv: int, alpha: np.ndarray, stream=0) -> None:
        calls = 1 if variant == "batched" else kv_heads
        (a, b, d), (sa, sb, sd) = self._shapes(kind, m, keys, ld_s, head_dim, kv_heads // calls, ld_kv)
        for h in range(calls):
            out = out_ptr + h * sd
            lt.matmul(
                self._handle, self._descs[kind], alpha.ctypes.data, kv_ptr + h * sa, a, x_ptr + h * sb, b,
                self._zero.ctypes.data, out, d, out, d, algo.ctypes.data, _ptr(self._workspace), WORKSPACE_BYTES,
                _stream_ptr(stream),
            )

    def _candidates(self, kind: str, variant: str, head_dim: int, m: int, keys: int) -> list[np.ndarray]:
        kv_heads = 2
        batch = kv_heads if variant == "batched" else 1
        (a, b, d), _ = self._shapes(kind, m, keys, keys, head_dim, batch, kv_heads * head_dim)
        pref = lt.matmul_preference_create()
        try:
            attr = lt.MatmulPreferenceAttribute
            _set(lt.matmul_preference_set_attribute, pref, int(attr.MAX_WORKSPACE_BYTES), WORKSPACE_BYTES, np.uint64)
            _set(lt.matmul_preference_set_attribute, pref, int(attr.REDUCTION_SCHEME_MASK), 0, np.uint32)
            for name in ("MIN_ALIGNMENT_A_BYTES", "MIN_ALIGNMENT_B_BYTES", "MIN_ALIGNMENT_C_BYTES",
                         "MIN_ALIGNMENT_D_BYTES"):
                _set(lt.matmul_preference_set_attribute, pref, int(getattr(attr, name)), 16, np.uint32)
            results = np.zeros(CANDIDATES * HEURISTIC_BYTES, np.uint8)
            count = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(self._handle, self._descs[kind], a, b, d, d, pref, CANDIDATES,
                                         results.ctypes.data, count.ctypes.data)
        finally:
            lt.matmul_preference_destroy(pref)
        return without_split_k(results, int(count[0]))

    def _probe(self, kind: str, variant: str, algo, head_dim: int, rng) -> bool:
        """True when `algo` gives S (or O) elements independent of the row count and the key
        count (for O: P zero past a row's keys, the key count padded), on random data;
        raises on an unsupported shape."""
        kv_heads, ld_kv, m_ref, keys_ref = 2, 2 * head_dim, 512, 2048
        kv = cuda.to_device(_bits(rng, (keys_ref, kv_heads * head_dim)))

        def run(x_host, m, keys):
            x = cuda.to_device(np.ascontiguousarray(x_host))
            shape = (kv_heads, m, keys if kind == self.QK else head_dim)
            out = cuda.device_array(shape, np.float32)
            self._run(kind, variant, algo, _ptr(kv), _ptr(x), _ptr(out), m, keys, keys, head_dim, kv_heads, ld_kv,
                      self._one)
            cuda.synchronize()
            return out.copy_to_host()

        if kind == self.QK:
            q = _bits(rng, (kv_heads, m_ref, head_dim))
            ref = run(q, m_ref, keys_ref)
            for m, keys in ((1, keys_ref), (7, 256), (64, 512), (129, 1024), (333, 1792), (m_ref, 256)):
                part = run(q[:, m_ref - m :], m, keys)
                if not np.array_equal(part, ref[:, m_ref - m :, :keys]):
                    return False
            return True
        p = _bits(rng, (kv_heads, m_ref, keys_ref), lo=0.0)
        for live in (57, 1000, 2047):
            keys = padded(live)
            zeroed = p.copy()
            zeroed[:, :, live:] = 0
            ref = run(zeroed, m_ref, keys_ref)
            for m in (1, 129, m_ref):
                if not np.array_equal(run(zeroed[:, m_ref - m :, :keys], m, keys), ref[:, m_ref - m :]):
                    return False
        return True

    def pin(self, kind: str, head_dim: int, seed: int = 0) -> tuple[str, np.ndarray]:
        """(layout variant, algorithm) for GEMM `kind` ("qk" or "pv") at this head_dim: the
        first heuristic candidate (no split-K) of the first variant that passes `_probe`.
        Raises RuntimeError (listing each candidate's outcome) when none does."""
        key = (kind, head_dim)
        if key in self._algos:
            return self._algos[key]
        rng = np.random.default_rng(seed)
        tried = []
        for variant in self.VARIANTS:
            try:
                candidates = self._candidates(kind, variant, head_dim, 1024, 4096)
            except Exception as exc:  # noqa: BLE001 - no heuristic for this variant
                tried.append(f"{variant} heuristic: {type(exc).__name__} {exc}")
                continue
            for index, algo in enumerate(candidates):
                try:
                    ok = self._probe(kind, variant, algo, head_dim, rng)
                except Exception as exc:  # noqa: BLE001 - an algorithm that rejects a probe shape is not usable
                    tried.append(f"{variant} {index}: {type(exc).__name__} {exc}")
                    continue
                tried.append(f"{variant} {index}: {'invariant' if ok else 'differs'}")
                if ok:
                    self._algos[key] = (variant, algo)
                    self.pinned[key] = {"variant": variant, "candidate": index, "algo_id": int(algo[0] & 0xFFFFFFFF),
                                        "tried": tried}
                    return self._algos[key]
        raise RuntimeError(f"no invariant cuBLASLt algorithm for attention {kind} at head_dim {head_dim}: {tried}")

    def ready(self, head_dim: int) -> bool:
        """Whether both GEMM kinds have (or can pin) an invariant algorithm at head_dim
        (the failure is kept in `self.failure`)."""
        self.failure = None
        if head_dim % 8:
            self.failure = f"head_dim {head_dim} is not a multiple of 8"
            return False
        if IS_SIMULATOR:
            return True
        try:
            self.pin(self.QK, head_dim)
            self.pin(self.PV, head_dim)
        except RuntimeError as exc:
            self.failure = str(exc)
            return False
        return True

    # scratch ------------------------------------------------------------------------------
    def _buffer(self, name: str, nbytes: int, stream=0):
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < nbytes:
            buf = empty((max(nbytes, 1),), np.uint8, stream)
            self._scratch[name] = buf
        return buf

    def _view(self, name: str, shape: tuple, dtype, stream=0):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        return self._buffer(name, n * dtype.itemsize, stream)[: n * dtype.itemsize].view(dtype).reshape(shape)

    # the two GEMMs ------------------------------------------------------------------------
    def _gemm(self, kind, kv_cache_head0, x, out, m, keys, ld_s, head_dim, kv_heads, alpha, stream):
        """kv_cache_head0: the slot's cache view [capacity, kv_heads, head_dim]."""
        if IS_SIMULATOR:
            kv = host_bf16_to_f32(kv_cache_head0[:keys].copy_to_host()).astype(np.float64)  # [keys, kvh, d]
            xs = host_bf16_to_f32(x.copy_to_host()).astype(np.float64)
            if kind == self.QK:  # x: [kvh, m, d] -> out [kvh, m, ld_s]
                res = np.einsum("hmd,khd->hmk", xs, kv) * float(alpha[0])
                host = np.zeros((kv_heads, m, ld_s), np.float32)
                host[:, :, :keys] = res.astype(np.float32)
            else:  # x: [kvh, m, ld_s] -> out [kvh, m, d]
                host = np.einsum("hmk,khd->hmd", xs[:, :, :keys], kv).astype(np.float32)
            out.copy_to_device(host, stream=stream)
            return
        variant, algo = self.pin(kind, head_dim)
        self._run(kind, variant, algo, _ptr(kv_cache_head0), _ptr(x), _ptr(out), m, keys, ld_s, head_dim, kv_heads,
                  kv_heads * head_dim, alpha, stream)

    def prefill(self, q, qg, kcache, vcache, slot: int, start: int, out=None, stream=0, budget: int = TILE_BYTES):
        """out = bf16(sigmoid_gate(attention(q, K, V), gate)) for rows at positions
        start, start + 1, ... of stream `slot`, each against keys [0, its position].

        q: f32 device [rows, q_heads, head_dim] (after QK-norm and RoPE); qg: f32
        [rows, q_heads * 2 * head_dim] (q_proj output; gate halves read); kcache, vcache:
        uint16 (bf16) [slots, capacity, kv_heads, head_dim] (one layer; rows
        [0, start + rows) written, every row finite, capacity at least
        padded(start + rows)); budget: scratch bytes per tile (`tile_rows`).
        Returns uint16 (bf16) [rows, q_heads * head_dim]. Raises ValueError on mismatched
        shapes or a head_dim not a multiple of 8. Twins: ops.attention, ops.sigmoid_gate.
        """
        check("q", q, np.float32, 3)
        check("qg", qg, np.float32, 2)
        check("kcache", kcache, np.uint16, 4)
        check("vcache", vcache, np.uint16, 4)
        rows, q_heads, head_dim = q.shape
        _, capacity, kv_heads, kd = kcache.shape
        if kd != head_dim or q_heads % kv_heads or head_dim % 8:
            raise ValueError(f"q {q.shape} does not fit the cache {kcache.shape} (head_dim must be a multiple of 8)")
        if tuple(qg.shape) != (rows, q_heads * 2 * head_dim) or padded(start + rows) > capacity:
            raise ValueError(f"qg {qg.shape} / rows [{start}, {start + rows}) do not fit")
        out = empty((rows, q_heads * head_dim), np.uint16, stream) if out is None else out
        if not rows:
            return out
        group = q_heads // kv_heads
        alpha = np.array([1.0 / math.sqrt(head_dim)], np.float32)
        ks, vs = kcache[slot], vcache[slot]
        step = tile_rows(rows, q_heads, start + rows, budget)
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            m = n * group
            keys = ld_s = padded(start + lo + n)
            qb = self._view("q", (kv_heads, m, head_dim), np.uint16, stream)
            s = self._view("s", (kv_heads, m, ld_s), np.float32, stream)
            p = self._view("p", (kv_heads, m, ld_s), np.uint16, stream)
            o = self._view("o", (kv_heads, m, head_dim), np.float32, stream)
            sums = self._view("l", (kv_heads, m), np.float32, stream)
            _pack_kernel[(n, q_heads), ROW_THREADS, stream](q, lo, group, qb)
            self._gemm(self.QK, ks, qb, s, m, keys, ld_s, head_dim, kv_heads, alpha, stream)
            _softmax_kernel[(m, kv_heads), ROW_THREADS, stream](s, start + lo, group, ld_s, p, sums)
            self._gemm(self.PV, vs, p, o, m, keys, ld_s, head_dim, kv_heads, self._one, stream)
            _finish_kernel[(n, q_heads), ROW_THREADS, stream](o, sums, qg, lo, group, out)
        return out
