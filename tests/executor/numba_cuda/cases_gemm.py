"""The cuBLASLt row range past the buckets (Gemm._large_algo: long prefill chunks) and the
device bit compare it uses. Run by test_kernels_simulated.py under the CUDA simulator, with
NumPy products standing in for cuBLASLt's algorithms; `pytest
tests/executor/numba_cuda/cases_gemm.py` on a GPU runs `unequal_words` on the device."""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda import gemm as gemm_module
from executor.numba_cuda.device import to_device
from executor.numba_cuda.gemm import BUCKETS, LARGE, LARGE_PROBES, LARGE_ROWS, RANGES, Gemm, bucket_probes, unequal_words
from tests.executor.numba_cuda.kernel_support import rng


def test_unequal_words_counts_differing_bits_not_values():
    """+0 and -0, and two NaN payloads, are equal values' or unordered values' bits that differ:
    counted; equal bits are not, whatever the shape."""
    r = rng()
    a = r.standard_normal((37, 53)).astype(np.float32)
    b = a.copy()
    assert unequal_words(to_device(a), to_device(b)) == 0
    a[0, 0], b[0, 0] = 0.0, -0.0
    b[5, 7] = np.nextafter(b[5, 7], np.float32(np.inf))
    a[36, 52] = np.uint32(0x7FC00000).view(np.float32)
    b[36, 52] = np.uint32(0x7FC00001).view(np.float32)
    assert unequal_words(to_device(a), to_device(b)) == 3
    big = r.standard_normal(1001).astype(np.float32)  # more words than one block has threads
    other = big.copy()
    other[::100] += 1
    assert unequal_words(to_device(big), to_device(other), max_blocks=1) == 11
    with pytest.raises(ValueError, match="shapes differ"):
        unequal_words(to_device(a), to_device(a[:3]))


def test_the_range_past_the_buckets_is_probed_at_its_own_rows():
    assert RANGES[:-1] == BUCKETS and RANGES[-1] == (BUCKETS[-1][1] + 1, LARGE)
    assert bucket_probes(*RANGES[-1]) == list(LARGE_PROBES)
    assert all(BUCKETS[-1][1] < m <= gemm_module.REFERENCE_ROWS for m in LARGE_PROBES)


def _fake(monkeypatch):
    """A Gemm whose algorithms (uint64[8], id in word 0) are NumPy products: id 7 adds one ulp
    to one element at M = 1537 only, id 4 to one element of row 5000 at LARGE_ROWS only, id 8
    refuses every M, the rest give the reference's bits; `_seconds` runs the product (at
    LARGE_ROWS rows only) and says the id's entry in `speed`."""
    gemm = Gemm.__new__(Gemm)
    gemm.large = True
    algo = {i: np.full(8, i, np.uint64) for i in range(10)}
    speed = {0: 5e-3, 1: 6e-3, 4: 0.5e-3, 5: 3e-3, 6: 4e-3, 7: 1e-3, 8: 1e-3, 9: 2e-3}

    def run(a, x, w, out, stream=0, accumulate=False):
        if int(a[0]) == 8:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        xs = (x.copy_to_host().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        ws = (w.copy_to_host().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        p = (xs @ ws.T).astype(np.float32)
        if int(a[0]) == 7 and x.shape[0] == 1537:
            p[1536, 3] = np.nextafter(p[1536, 3], np.float32(np.inf))
        if int(a[0]) == 4 and x.shape[0] == LARGE_ROWS:
            p[5000, 1] = np.nextafter(p[5000, 1], np.float32(np.inf))
        out.copy_to_device(p)

    def seconds(a, x, weights, out):
        assert x.shape[0] == LARGE_ROWS, "timed at LARGE_ROWS"
        gemm._run(a, x, weights[0], out)
        return speed[int(a[0])]

    gemm._run = run
    gemm._seconds = seconds
    gemm._candidates = lambda n, k, m: [algo[i] for i in (6, 4, 7, 8, 9, 0, 5)] if m == LARGE_ROWS else []
    monkeypatch.setattr(gemm_module, "flip_swizzle", lambda a: algo[1])
    # the bit compare on the host here: the simulator runs unequal_words' threads one by one
    monkeypatch.setattr(gemm_module, "unequal_words", lambda a, b: int(np.count_nonzero(
        a.copy_to_host().view(np.uint32) != b.copy_to_host().view(np.uint32))))
    return gemm, algo


def test_large_rows_run_the_fastest_bit_equal_algorithm(monkeypatch):
    """Of the reference (id 0, 5 ms), its swizzle flipped (id 1, 6 ms) and the heuristic's first
    BUCKET_CANDIDATES at LARGE_ROWS, the fastest whose rows equal the reference's at every
    LARGE_PROBES count and at LARGE_ROWS runs: not id 4 (one ulp in row 5000 of the LARGE_ROWS
    product, fastest of all), not id 7 (one ulp at M = 1537), not id 8 (refuses), but id 9 (2 ms)
    over 5 and 6; the reference again is not counted twice."""
    gemm, algo = _fake(monkeypatch)
    r = rng()
    x = to_device((r.standard_normal((gemm_module.REFERENCE_ROWS, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    w = to_device((r.standard_normal((16, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    best, entry = gemm._large_algo(algo[0], x, w, [w])
    assert int(best[0]) == 9
    assert entry.pop("search_s") >= 0
    assert entry == {"rows": [BUCKETS[-1][1] + 1, None], "timed_at": LARGE_ROWS, "candidates": 7,
                     "bit_equal_candidates": 4, "reference_us": 5000.0, "chosen_us": 2000.0, "algo_id": 9}
    # no faster equal candidate: the reference itself
    slow = gemm._seconds
    gemm._seconds = lambda a, x, weights, out: slow(a, x, weights, out) * 0 + (1e-3 if int(a[0]) in (0, 4, 7, 8) else 9e-3)
    best, entry = gemm._large_algo(algo[0], x, w, [w])
    assert best is algo[0] and entry["algo_id"] == 0 and entry["bit_equal_candidates"] == 4
    # the reference refusing LARGE_ROWS (or no memory for the search): the reference, and why
    refusing = gemm._run

    def run(a, x, w, out, stream=0, accumulate=False):
        if x.shape[0] == LARGE_ROWS:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        refusing(a, x, w, out)

    gemm._run = run
    best, entry = gemm._large_algo(algo[0], x, w, [w])
    assert best is algo[0] and "NOT_SUPPORTED" in entry["failed"] and "timed_at" not in entry


def test_algo_for_gives_every_m_past_the_buckets_the_large_algorithm(monkeypatch):
    gemm, algo = _fake(monkeypatch)
    gemm.pinned, gemm.refused = {}, {}
    gemm._algos = {(16, 24): algo[0]}
    gemm._buckets = {(16, 24): [(hi, algo[2 + i]) for i, (_, hi) in enumerate(BUCKETS)] + [(LARGE, algo[9])]}
    gemm.pin = lambda n, k: gemm._algos[(n, k)]
    got = {m: int(gemm.algo_for(m, 16, 24)[0]) for m in (1, 16, 17, 1024, 1025, 2048, 32768, 1 << 40)}
    assert got == {1: 2, 16: 2, 17: 3, 1024: 5, 1025: 9, 2048: 9, 32768: 9, 1 << 40: 9}
    gemm.refused[(32768, 16, 24)] = "refused"
    assert gemm.algo_for(32768, 16, 24) is algo[0]
    gemm.large = False  # the A side: the reference past the buckets, the buckets as before
    assert [int(gemm.algo_for(m, 16, 24)[0]) for m in (1024, 1025, 40000)] == [5, 0, 0]


def test_large_off_from_the_start_searches_nothing(monkeypatch):
    monkeypatch.setenv(gemm_module.LARGE_ENV, " 0 ")
    assert Gemm().large is False
    monkeypatch.setenv(gemm_module.LARGE_ENV, "1")
    assert Gemm().large is True
    gemm, algo = _fake(monkeypatch)
    gemm.large = False
    gemm._candidates = gemm._seconds = None  # never asked
    best, entry = gemm._large_algo(algo[0], to_device(np.zeros((gemm_module.REFERENCE_ROWS, 24), np.uint16)),
                                   to_device(np.zeros((16, 24), np.uint16)), [])
    assert best is algo[0] and entry == {"rows": [BUCKETS[-1][1] + 1, None], "off": "WARMSTATE_GEMM_LARGE=0", "algo_id": 0}


def test_unequal_rounded_counts_elements_off_the_bf16_rounding():
    """a (bf16 bits) against the round-to-nearest-even of b (f32): ties go to the even bf16, so
    truncating a tie is counted, as is a wrong sign of zero; equal bits are not."""
    from executor.numba_cuda.gemm import unequal_rounded
    from executor.safetensors_file import f32_to_bf16

    r = rng()
    b = r.standard_normal((5, 7)).astype(np.float32)
    b[0, 0] = np.uint32(0x3F808000).view(np.float32)  # a tie: 1.00390625 rounds to even 0x3F80
    b[0, 1] = np.uint32(0x3F818000).view(np.float32)  # a tie rounding up to 0x3F82
    b[1, 1] = -0.0
    a = f32_to_bf16(b)
    assert (int(a[0, 0]), int(a[0, 1])) == (0x3F80, 0x3F82)
    assert unequal_rounded(to_device(a), to_device(b)) == 0
    a[0, 1] = 0x3F81  # truncated, not rounded
    a[1, 1] = 0x0000  # +0 for -0
    a[4, 6] ^= 1
    assert unequal_rounded(to_device(a), to_device(b)) == 3
    with pytest.raises(ValueError, match="shapes differ"):
        unequal_rounded(to_device(a), to_device(b[:3]))


def _fake_bf16(monkeypatch):
    """`_fake`'s Gemm whose algorithms also write a bf16 D (the round-to-nearest-even of their
    f32 product); for bf16: id 3 truncates one element at M = 1026, id 4 one of row 5000 at
    LARGE_ROWS, id 8 refuses; `_candidates` with a bf16 D offers ids 3, 4, 5, 8, 9, 6. IS_SIMULATOR
    off for the test: bf16_ready then searches, as on a GPU."""
    from executor.safetensors_file import f32_to_bf16

    gemm, algo = _fake(monkeypatch)
    monkeypatch.setattr(gemm_module, "IS_SIMULATOR", False)  # bf16_ready asks bf16_algo, as on a GPU
    speed = {0: 5e-3, 3: 0.5e-3, 4: 0.5e-3, 5: 3e-3, 6: 1e-3, 8: 1e-3, 9: 2e-3}  # 0: the f32 path
    f32_run = gemm._run

    def run(a, x, w, out, stream=0, accumulate=False):
        if out.dtype != np.uint16:
            return f32_run(a, x, w, out, stream, accumulate)
        if int(a[0]) == 8:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        p = gemm_module.empty(tuple(out.shape), np.float32)
        f32_run(algo[0], x, w, p)
        d = f32_to_bf16(p.copy_to_host())
        if int(a[0]) == 3 and x.shape[0] == 1026:
            d[1025, 2] ^= 1
        if int(a[0]) == 4 and x.shape[0] == LARGE_ROWS:
            d[5000, 1] ^= 1
        out.copy_to_device(d)

    def seconds(a, x, weights, out):
        assert x.shape[0] == LARGE_ROWS, "timed at LARGE_ROWS"
        gemm._run(a, x, weights[0], out)
        return speed[int(a[0])]

    gemm._run, gemm._seconds = run, seconds
    gemm._candidates = lambda n, k, m, d_type=gemm_module.CUDA_R_32F: (
        [algo[i] for i in (3, 4, 5, 8, 9, 6)] if d_type == gemm_module.CUDA_R_16BF and m == LARGE_ROWS else [])
    gemm.pinned, gemm._bf16, gemm._algos = {(16, 24): {}}, {}, {(16, 24): algo[0]}
    gemm._buckets, gemm.refused, gemm.refused_bf16 = {(16, 24): [(LARGE, algo[0])]}, {}, {}
    gemm.speed = speed
    gemm.pin = lambda n, k: gemm._algos[(n, k)]
    monkeypatch.setattr(gemm_module, "unequal_rounded", lambda a, b: int(np.count_nonzero(
        a.copy_to_host() != f32_to_bf16(b.copy_to_host()))))
    return gemm, algo


def test_bf16_output_runs_the_fastest_algorithm_that_rounds_the_reference(monkeypatch):
    """Of the bf16-D candidates, the fastest whose output is the bf16 rounding of the reference's
    f32 output at every LARGE_PROBES count and at LARGE_ROWS: not id 3 (one bit at M = 1026) nor
    id 4 (one bit in row 5000 at LARGE_ROWS), both fastest, nor id 8 (refuses), but id 6 (1 ms)
    over 5 and 9, and faster than the f32 path (id 0, 5 ms); found once a shape. Large off: none,
    and no search."""
    gemm, algo = _fake_bf16(monkeypatch)
    best = gemm.bf16_algo(16, 24)
    assert int(best[0]) == 6
    entry = gemm.pinned[(16, 24)]["bf16"]
    assert entry.pop("search_s") >= 0
    assert entry == {"timed_at": LARGE_ROWS, "candidates": 6, "bit_equal_candidates": 3, "f32_us": 5000.0,
                     "fastest_us": 1000.0, "algo_id": 6}
    gemm._candidates = None  # never asked again
    assert gemm.bf16_algo(16, 24) is best
    assert gemm.bf16_ready(1025, 16, 24) and not gemm.bf16_ready(1024, 16, 24)
    gemm.large = False  # turned off after the search (bench.decode_prefill --gemm-large on,off): no bf16 output
    assert not gemm.bf16_ready(4096, 16, 24)
    with pytest.raises(ValueError, match="Gemm.large is off"):
        gemm.matmul(to_device(np.zeros((4096, 24), np.uint16)), to_device(np.zeros((16, 24), np.uint16)), bf16=True)
    gemm.large = True
    assert gemm.bf16_ready(4096, 16, 24)
    off, _ = _fake_bf16(monkeypatch)
    off.large = False
    off._candidates = None
    assert off.bf16_algo(16, 24) is None and off.pinned[(16, 24)]["bf16"] == {"off": "Gemm.large is off"}
    assert not off.bf16_ready(4096, 16, 24)


def test_a_bf16_product_slower_than_the_f32_one_is_not_used(monkeypatch):
    gemm, algo = _fake_bf16(monkeypatch)
    gemm.speed[0] = 0.9e-3  # the f32 path beats id 6 (1 ms)
    assert gemm.bf16_algo(16, 24) is None
    entry = gemm.pinned[(16, 24)]["bf16"]
    assert entry["slower_than_f32"] and entry["fastest_us"] == 1000.0 and entry["f32_us"] == 900.0
    assert not gemm.bf16_ready(4096, 16, 24)


def test_an_m_the_bf16_algorithm_refused_runs_in_f32(monkeypatch):
    gemm, algo = _fake_bf16(monkeypatch)
    assert gemm.bf16_ready(3000, 16, 24)
    gemm.refused_bf16[(3000, 16, 24)] = "refused"
    assert not gemm.bf16_ready(3000, 16, 24) and gemm.bf16_ready(3001, 16, 24)


def test_no_candidate_rounding_the_reference_leaves_the_f32_path(monkeypatch):
    gemm, algo = _fake_bf16(monkeypatch)
    gemm._candidates = lambda n, k, m, d_type=gemm_module.CUDA_R_32F: [algo[3], algo[8]]
    assert gemm.bf16_algo(16, 24) is None
    assert gemm.pinned[(16, 24)]["bf16"]["bit_equal_candidates"] == 0
    with pytest.raises(ValueError, match="bf16: M=2048, N=16, K=24: no bf16-output algorithm"):
        gemm.matmul(to_device(np.zeros((2048, 24), np.uint16)), to_device(np.zeros((16, 24), np.uint16)), bf16=True)


def test_matmul_bf16_gives_the_rounding_of_the_f32_product():
    """matmul(..., bf16=True) past the buckets: the bf16 rounding of matmul's f32 product, bit for
    bit, into a new or a given uint16 array; refused at 1,024 rows and below, with accumulate,
    and into a wrong out, each naming the field."""
    from executor.safetensors_file import f32_to_bf16

    if not gemm_module.IS_SIMULATOR:
        pytest.skip("the simulator's NumPy product; on a GPU test_gpu_backend and bench.decode_prefill check it")
    r = rng()
    gemm = Gemm()
    x = to_device((r.standard_normal((1025, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    w = to_device((r.standard_normal((16, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    f32 = gemm.matmul(x, w).copy_to_host()
    got = gemm.matmul(x, w, bf16=True)
    assert got.dtype == np.uint16 and tuple(got.shape) == (1025, 16)
    np.testing.assert_array_equal(got.copy_to_host(), f32_to_bf16(f32))
    given = to_device(np.zeros((1025, 16), np.uint16))
    assert gemm.matmul(x, w, out=given, bf16=True) is given
    np.testing.assert_array_equal(given.copy_to_host(), f32_to_bf16(f32))
    with pytest.raises(ValueError, match="bf16: M=1024, N=16, K=24: runs M past 1024 rows only"):
        gemm.matmul(to_device(x.copy_to_host()[:1024]), w, bf16=True)
    with pytest.raises(ValueError, match="bf16: an output in bf16 cannot accumulate"):
        gemm.matmul(x, w, out=given, bf16=True, accumulate=True)
    with pytest.raises(ValueError, match="out"):
        gemm.matmul(x, w, out=to_device(np.zeros((1025, 16), np.float32)), bf16=True)


@pytest.mark.parametrize("n,k", [(24576, 4096), (34816, 5120)], ids=["9b-gate-up", "27b-gate-up"])
def test_bf16_products_on_the_gpu_are_the_rounding_of_the_f32_ones(n, k):
    """On a GPU, at the 9B's and the 27B's gate|up shapes: matmul(..., bf16=True) at 1,025, 1,300
    and 8,193 rows is the bf16 rounding of matmul's f32 product bit for bit (whichever algorithm
    bf16_algo kept), or the shape has none and says why."""
    from executor.numba_cuda.gemm import unequal_rounded

    if gemm_module.IS_SIMULATOR:
        pytest.skip("cuBLASLt's own bf16 epilogue: a GPU")
    r = rng()
    gemm = Gemm()
    w = to_device((r.standard_normal((n, k), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    if not gemm.bf16_ready(8193, n, k):
        pytest.skip(f"no bf16 algorithm kept for ({n}, {k}): {gemm.pinned[(n, k)]['bf16']}")
    assert gemm.pinned[(n, k)]["bf16"]["bit_equal_candidates"] >= 1
    for m in (1025, 1300, 8193):
        x = to_device((r.standard_normal((m, k), np.float32).view(np.uint32) >> 16).astype(np.uint16))
        assert unequal_rounded(gemm.matmul(x, w, bf16=True), gemm.matmul(x, w)) == 0, m


def test_products_take_bf16_past_1024_prefill_rows_only():
    """NumbaCudaBackend._product (in_proj and gate|up; the simulator's NumPy products): bf16 for
    a prefill chunk of more than 1,024 rows with bf16_products on, f32 at 1,024 rows, with it off and in decode
    (GEMV); the bf16 product is the f32 one's rounding."""
    from executor.numba_cuda.backend import NumbaCudaBackend
    from executor.numba_cuda.gemv import gemv
    from executor.safetensors_file import f32_to_bf16

    if not gemm_module.IS_SIMULATOR:
        pytest.skip("routing only; on a GPU test_gpu_backend checks the bits end to end")
    r = rng()
    stub = NumbaCudaBackend.__new__(NumbaCudaBackend)
    stub.gemm, stub.bf16_products = Gemm(), True
    h = to_device((r.standard_normal((1025, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    w = to_device((r.standard_normal((16, 24), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    mm = stub.gemm.matmul
    long = stub._product(h, w, mm, 0)
    assert long.dtype == np.uint16
    np.testing.assert_array_equal(long.copy_to_host(), f32_to_bf16(mm(h, w).copy_to_host()))
    assert stub._product(to_device(h.copy_to_host()[:1024]), w, mm, 0).dtype == np.float32
    assert stub._product(to_device(h.copy_to_host()[:3]), w, gemv, 0).dtype == np.float32
    assert stub._product(h, w, mm, 0, 32).dtype == np.float32  # N = 16 columns: not a multiple of 32
    assert stub._product(h, w, mm, 0, 16).dtype == np.uint16
    stub.bf16_products = False
    assert stub._product(h, w, mm, 0).dtype == np.float32
