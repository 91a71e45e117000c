"""bf16 GEMMs through cuBLASLt (nvmath-python bindings) on numba device memory, with one
algorithm pinned per (N, K) so a row's bits never depend on the number of rows.

Y[M, N] = X[M, K] @ W[N, K]^T, bf16 inputs, fp32 compute and fp32 output. cuBLAS's
default heuristics pick by M and are not row-invariant for some Qwen3.5 shapes (GPU notes
in DESIGN.md), so `pin` takes the heuristic candidates at a reference M without split-K,
and keeps the first one whose rows at probe row counts equal its rows at the reference M
bit for bit on random data; that algorithm then runs for every M. Twin: ops.linear.
Under the CUDA simulator (no cuBLAS) `matmul` multiplies the host copies in NumPy.
"""

from __future__ import annotations

import numpy as np

from executor.numba_cuda.device import IS_SIMULATOR, check, empty, to_device
from executor.safetensors_file import bf16_to_f32

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


def _ptr(array) -> int:
    return int(array.__cuda_array_interface__["data"][0])


def _stream_ptr(stream) -> int:
    if stream == 0 or stream is None:
        return 0
    handle = stream.handle
    return int(handle.value if hasattr(handle, "value") else handle) or 0


def _set(setter, obj, attr: int, value, dtype) -> None:
    buf = np.array([value], dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


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


class Gemm:
    """cuBLASLt handle, workspace and pinned algorithms of one device.

    `matmul(x, w)` computes x @ w.T for bf16 (uint16) device arrays x [M, K], w [N, K]
    (both C-contiguous, 256-byte aligned: fresh allocations) into a new fp32 [M, N].
    """

    def __init__(self) -> None:
        self.pinned: dict[tuple[int, int], dict] = {}
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
        self._layouts: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        self._algos: dict[tuple[int, int], np.ndarray] = {}

    def _layout(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        key = (m, n, k)
        if key not in self._layouts:
            a = lt.matrix_layout_create(CUDA_R_16BF, k, n, k)
            b = lt.matrix_layout_create(CUDA_R_16BF, k, m, k)
            d = lt.matrix_layout_create(CUDA_R_32F, n, m, n)
            self._layouts[key] = (a, b, d)
        return self._layouts[key]

    def _candidates(self, n: int, k: int) -> list[np.ndarray]:
        pref = lt.matmul_preference_create()
        try:
            _set(lt.matmul_preference_set_attribute, pref, 1, WORKSPACE_BYTES, np.uint64)  # MAX_WORKSPACE_BYTES
            _set(lt.matmul_preference_set_attribute, pref, 3, 0, np.uint32)  # REDUCTION_SCHEME_MASK: none
            a, b, d = self._layout(REFERENCE_ROWS, n, k)
            results = np.zeros(CANDIDATES * HEURISTIC_BYTES, np.uint8)
            count = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(
                self._handle, self._desc, a, b, d, d, pref, CANDIDATES, results.ctypes.data, count.ctypes.data
            )
        finally:
            lt.matmul_preference_destroy(pref)
        return without_split_k(results, int(count[0]))

    def _run(self, algo: np.ndarray, x, w, out, stream=0) -> None:
        m, k = x.shape
        n = w.shape[0]
        a, b, d = self._layout(m, n, k)
        lt.matmul(
            self._handle, self._desc, self._alpha.ctypes.data, _ptr(w), a, _ptr(x), b,
            self._beta.ctypes.data, _ptr(out), d, _ptr(out), d, algo.ctypes.data,
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
        bits = lambda shape: (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        w = to_device(bits((n, k)))
        x = to_device(bits((REFERENCE_ROWS, k)))
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
                self._algos[key] = algo
                self.pinned[key] = {"candidate": index, "algo_id": int(algo[0] & 0xFFFFFFFF), "tried": tried}
                return algo
        raise RuntimeError(f"no row-invariant cuBLASLt algorithm for N={n}, K={k}: {tried}")

    def matmul(self, x, w, out=None, stream=0):
        """out = x @ w.T (fp32) with the pinned algorithm of (N, K).

        x: uint16 (bf16) device [M, K]; w: uint16 (bf16) [N, K]; returns f32 [M, N].
        """
        check("x", x, np.uint16, 2)
        check("w", w, np.uint16, 2)
        m, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k:
            raise ValueError(f"w has {w.shape[1]} columns, x has {k}")
        out = empty((m, n), np.float32, stream) if out is None else out
        if m and IS_SIMULATOR:  # the CUDA simulator has no cuBLAS: NumPy on the host copies
            xs, ws = bf16_to_f32(x.copy_to_host()), bf16_to_f32(w.copy_to_host())
            out.copy_to_device((xs.astype(np.float64) @ ws.T.astype(np.float64)).astype(np.float32))
        elif m:
            self._run(self.pin(n, k), x, w, out, stream)
        return out
