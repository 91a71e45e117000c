"""Device memory of the GPU backend: the activation peak `reserve_cache` measures, and the
27B-shape server's start-up (bench/memory.py), which in session 14 left the prompt cache
nothing (bench/RESULTS.md). Marked `cuda`; skips cleanly without an NVIDIA GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("nvmath")

from executor.model import random_checkpoint  # noqa: E402
from executor.numba_cuda import device  # noqa: E402
from executor.numba_cuda.backend import NumbaCudaBackend  # noqa: E402
from executor.weights import load_weights  # noqa: E402
from tests.executor.qwen_support import small_config  # noqa: E402

ROOT = Path(__file__).parents[3]
GIB = 1 << 30


def test_activation_peak_is_measured_repeatably_and_changes_no_state(tmp_path):
    if device.POOL is None:
        pytest.skip("WARMSTATE_DEVICE_POOL=0: no pool to measure")
    config = small_config()
    gpu = NumbaCudaBackend(load_weights(random_checkpoint(config, seed=5, out_dir=tmp_path)), slots=3,
                           capacity_rows=512)
    free_slots = list(gpu.pool._free)
    gpu.activation_peak(512)  # the first prefill compiles and pins GEMM algorithms (their scratch counts)
    small, big = gpu.activation_peak(64), gpu.activation_peak(256)
    assert 0 < small < big, (small, big)
    assert gpu.activation_peak(256) == big  # the same chunk takes the same blocks
    assert gpu.activation_peak(10_000) == gpu.activation_peak(512)  # capped at the capacity
    assert sorted(gpu.pool._free) == sorted(free_slots)
    held = gpu.reserve_cache(64 << 20, chunk_rows=256)  # the headroom measured: a tiny model's fits
    assert held == 64 << 20
    gpu.pool.memory.trim()
    gpu.pool.memory = None


def test_the_27b_server_shape_reserves_a_prompt_cache(tmp_path):
    """The server's backend at the 27B shape (18 slots at 32768 rows, random weights, decode
    graphs for 16 lane counts and prefill graphs) leaves at least 32 GiB for the prompt
    cache on an H200-class GPU; its weights and state pool take their own bytes (no pool
    rounding) and the decode graphs' own buffers under 2 GiB. Session 14: no cache (the graphs held 20
    GiB, the headroom was 20 GiB). On a smaller GPU it skips before the start-up, which there
    runs out of memory (an H100's 80 GB: session 39 found the check after it never reached)."""
    from numba import cuda

    total = cuda.current_context().get_memory_info()[1]
    if total < 120 * GIB:
        pytest.skip(f"a {total / GIB:.0f} GiB GPU cannot hold the 27B server")
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "bench.memory", "--preset", "qwen3.5-27b",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    if report["total"] < 120 * GIB:
        pytest.skip(f"a {report['total'] / GIB:.0f} GiB GPU cannot hold the 27B server")
    stages = {s["stage"]: s for s in report["stages"]}
    for name in ("weights", "state_pool"):
        took, expected = stages[name]["took"], stages[name]["expected"]
        assert expected <= took <= expected * 1.01 + (256 << 20), (name, took, expected)
    graphs = stages["decode_graphs"]  # less the eager rounds' blocks cached in device.POOL (freed before the reserve)
    assert graphs["took"] - (graphs["pool_cached"] - stages["state_pool"]["pool_cached"]) < 2 * GIB, done.stdout
    assert report["reserved"] >= 32 * GIB, done.stdout
