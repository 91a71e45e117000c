"""The streaming GEMM's CUDA C++ (executor/numba_cuda/gemm_stream.cu) on the CPU, through the host
emulator (emulator/cuda_host.h, with the bf16 ldmatrix, mma and cp.async of
emulator/gemm_stream_host.cpp). CI has no GPU and the numba simulator cannot run linked CUDA C++,
so this is where CI checks that code: values against float64 on the bf16 inputs for every
variant `gemm_stream.VARIANTS` lists and every m-tile count, every output element written and
none outside, rows that do not depend on the row count or on the CTA shape, the same bits for
every thread schedule, and a planted missing barrier caught. On the H200, bench/gemm_short.py
compares the kernel's bits with the pinned cuBLASLt algorithm's and times both. Skips when no
C++ compiler is found.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from executor.numba_cuda.gemm_stream import MAX_ROWS, VARIANTS, Variant
from tests.executor.numba_cuda.kernel_support import build_emulated

HERE = Path(__file__).parent / "emulator"
SOURCE = Path(__file__).parents[3] / "executor" / "numba_cuda" / "gemm_stream.cu"
PLANTED_BARRIER = "__syncthreads();  // tile kt is in for every thread; every warp is done with tile kt - 1"
"""The loop's barrier before the next tile's copies go into the buffer that tile kt - 1 used:
removed, a warp that runs ahead overwrites a tile the others still read."""


def device_code(source: str, drop_barrier: bool = False) -> str:
    """gemm_stream.cu's device code as host C++ (the PTX helpers are the runner's), its static
    shared memory the emulator's block buffer. Raises ValueError when the source lost a marker."""
    markers = ("// One K tile", "// Entry points", "extern __shared__ __align__(16) bf16_t smem[];")
    missing = [m for m in markers if m not in source]
    if missing:
        raise ValueError(f"gemm_stream.cu no longer has {missing}: update device_code")
    body = source[source.index(markers[0]) : source.index(markers[1])]
    body = body.replace(markers[2], "bf16_t* smem = reinterpret_cast<bf16_t*>(g_smem);")
    if drop_barrier:
        if body.count(PLANTED_BARRIER) != 1:
            raise ValueError(f"gemm_stream.cu no longer has exactly one {PLANTED_BARRIER!r}")
        body = body.replace(PLANTED_BARRIER, "/* planted: barrier removed */")
    return "typedef unsigned short bf16_t;\n" + body


def _build(out_dir: Path, code: str) -> Path:
    return build_emulated(out_dir, code, "gemm_stream", "-O1")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    code = device_code(SOURCE.read_text())
    text = code + (HERE / "cuda_host.h").read_text() + (HERE / "gemm_stream_host.cpp").read_text()
    return _build(tmp_path_factory.mktemp(f"gemm-host-{hashlib.sha256(text.encode()).hexdigest()[:12]}"), code)


def _bf16(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _launch(exe, tmp, x, w, variant: Variant, env=None):
    d = Path(tmp)
    np.ascontiguousarray(x).tofile(d / "x.bin")
    np.ascontiguousarray(w).tofile(d / "w.bin")
    (m, k), n = x.shape, w.shape[0]
    args = [exe, d, variant.warps, variant.columns_per_warp, -(-m // 16), variant.k_tile, variant.stages, m, n, k]
    base = {key: v for key, v in os.environ.items() if not key.startswith("DELTA_HOST_")}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env={**base, **(env or {})})


def _run(exe, tmp, x, w, variant: Variant, env=None) -> np.ndarray:
    done = _launch(exe, tmp, x, w, variant, env)
    assert done.returncode == 0, f"emulated launch failed: {done.stderr[-2000:]}"
    return np.fromfile(Path(tmp) / "y.bin", np.float32).reshape(x.shape[0], w.shape[0])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label().replace(" ", "-"))
@pytest.mark.parametrize("m", [1, 17, 40, 64])
def test_emulated_values_and_row_invariance(host, tmp_path, variant, m):
    """Against float64 on the bf16 inputs for each m-tile count; N not a multiple of the CTA's
    columns (a partial last CTA); the same rows bit for bit as the 64-row product."""
    rng = np.random.default_rng(m * 31 + variant.columns)
    k, n = 2 * variant.k_tile * 3, variant.columns + 24
    x, w = _bf16(rng, (MAX_ROWS, k)), _bf16(rng, (n, k))
    want = _f64(x[-m:]) @ _f64(w).T
    got = _run(host, tmp_path, x[-m:], w, variant)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-6, err
    np.testing.assert_array_equal(got, _run(host, tmp_path, x, w, variant)[-m:])


def test_emulated_bits_for_every_cta_shape_and_schedule(host, tmp_path):
    """One product through every variant and thread schedule (in order, reversed, shuffled, one
    warp running ahead to its next barrier, copies landing at issue): the same bits. The
    emulator's switches keep the names they got for the delta rule's runner:
    DELTA_HOST_ORDER=0..4 (schedule) and DELTA_HOST_EAGER=1 (copies land at issue)."""
    rng = np.random.default_rng(7)
    x, w = _bf16(rng, (51, 384)), _bf16(rng, (136, 384))
    want = _run(host, tmp_path, x, w, VARIANTS[0])
    assert all(v.fits(136, 384) for v in VARIANTS)
    for variant in VARIANTS[1:]:
        np.testing.assert_array_equal(_run(host, tmp_path, x, w, variant), want)
    for env in ({"DELTA_HOST_ORDER": "1"}, {"DELTA_HOST_ORDER": "2"}, {"DELTA_HOST_ORDER": "3"},
                {"DELTA_HOST_ORDER": "4"}, {"DELTA_HOST_EAGER": "1"}):
        np.testing.assert_array_equal(_run(host, tmp_path, x, w, Variant(8, 16, 128, 3), env), want)


def test_emulated_planted_missing_barrier_is_caught(tmp_path):
    """Without PLANTED_BARRIER, the first warp running ahead (DELTA_HOST_ORDER=3) copies a later
    tile over one the other warps still read: the emulator aborts on the NaN of a copy in flight
    reaching an mma, or the values come out wrong."""
    exe = _build(tmp_path / "planted", device_code(SOURCE.read_text(), drop_barrier=True))
    rng = np.random.default_rng(3)
    x, w = _bf16(rng, (33, 256)), _bf16(rng, (64, 256))
    done = _launch(exe, tmp_path, x, w, Variant(4, 16, 32, 4), {"DELTA_HOST_ORDER": "3"})
    if done.returncode:
        assert done.returncode == -6, done.stderr[-2000:]  # SIGABRT from a check, not a usage error
        assert "is NaN" in done.stderr or "unwritten" in done.stderr, done.stderr[-2000:]
        return
    got = np.fromfile(tmp_path / "y.bin", np.float32).reshape(33, 64)
    want = _f64(x) @ _f64(w).T
    assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()


def test_host_runner_instantiates_every_variant():
    """The runner's CASE list is gemm_stream.VARIANTS (a new variant gets emulated too)."""
    text = (HERE / "gemm_stream_host.cpp").read_text()
    listed = {tuple(int(v) for v in line.split("(")[1].split(")")[0].split(","))
              for line in text.splitlines() if line.strip().startswith("CASE(") and "define" not in line}
    assert listed == {(v.warps, v.columns_per_warp, v.k_tile, v.stages) for v in VARIANTS}


def test_variant_fields_and_shapes_outside_the_source_s_limits_are_refused():
    """A hand-made Variant the source cannot run (a partial n-tile, a K tile that drops columns,
    no warps, one stage) fails at construction, naming the field; shapes it cannot take say why."""
    for kwargs, field in ((dict(warps=4, columns_per_warp=12), "columns_per_warp"),
                          (dict(warps=4, columns_per_warp=16, k_tile=48), "k_tile"),
                          (dict(warps=0, columns_per_warp=16), "warps"),
                          (dict(warps=4, columns_per_warp=16, stages=1), "stages")):
        with pytest.raises(ValueError, match=f"Variant.{field}"):
            Variant(**kwargs)
    v = Variant(4, 16, 128, 3)
    assert v.unfit(64, 256) is None and v.fits(64, 256)
    assert "N must be" in v.unfit(0, 256) and "N must be" in v.unfit(12, 256)
    assert "K must be" in v.unfit(64, 0) and "K must be" in v.unfit(64, 192)
    assert "shared memory" in Variant(32, 256, 256, 8).unfit(64, 256)
