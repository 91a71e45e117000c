"""Helpers for the kernel cases: random inputs, bf16 round trips, unwritten-output checks, and
the build of the host emulator's kernel runners (`build_emulated`).

Imported by the `cases_*.py` files, which run under the CUDA simulator in a subprocess
(test_kernels_simulated.py) or directly on a GPU, and by the GPU and emulator tests of the
tensor-core delta rule and the streaming GEMM; nothing here imports numba.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from executor.reference import ops
from executor.safetensors_file import bf16_to_f32, f32_to_bf16


def rng() -> np.random.Generator:
    """Fresh random inputs on every run (the seed is printed on failure by the caller)."""
    return np.random.default_rng()


delta_inputs = ops.random_delta_inputs
"""Random inputs of a prefill delta rule (`executor.reference.ops.random_delta_inputs`, shared with
bench/delta_walk.py)."""


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, as bits (uint16)."""
    return f32_to_bf16(np.asarray(x, np.float32))


def as_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits to float32."""
    return bf16_to_f32(bits)


def host(array) -> np.ndarray:
    """Device array to host, asserting every element was written (no poison left)."""
    out = array.copy_to_host()
    values = bf16_to_f32(out) if out.dtype == np.uint16 else out
    if values.dtype.kind == "f":
        assert np.isfinite(values).all(), f"{np.count_nonzero(~np.isfinite(values))} elements unwritten or non-finite"
    return out


def assert_grid_invariant(run, to_device, state0: np.ndarray, start_row: int, rows: int, chunkings) -> None:
    """A delta rule's output and final state from rows [0, rows) in one chunk equal those from
    each of `chunkings` (cut lists from 0 to rows), bit for bit. run(states, start_row, cuts):
    the output of the cut chunks on a device state (advanced in place); to_device: the upload
    the caller's runtime uses; state0: the host state the runs start from."""
    states = to_device(state0)
    whole = run(states, start_row, [0, rows])
    final = states.copy_to_host()
    for cuts in chunkings:
        states = to_device(state0)
        np.testing.assert_array_equal(run(states, start_row, cuts), whole, err_msg=str(cuts))
        np.testing.assert_array_equal(states.copy_to_host(), final, err_msg=str(cuts))


EMULATOR = Path(__file__).parent / "emulator"
"""The host emulator of CUDA C++ (cuda_host.h, cuda_host.cpp) and its kernel runners."""


def build_emulated(out_dir: Path, code: str, name: str, opt: str = "-O2") -> Path:
    """Compile the runner emulator/{name}_host.cpp with `code` (a kernel source's device code as
    host C++, written to {name}_kernels.inc) and the emulator, into out_dir/{name}_host; skips
    the test when no C++ compiler is found, fails it with the compiler's errors."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler for the host emulator")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}_kernels.inc").write_text(code)
    exe = out_dir / f"{name}_host"
    cmd = [compiler, opt, "-std=c++17", "-ffp-contract=off", f"-I{EMULATOR}", f"-I{out_dir}", "-o", str(exe),
           str(EMULATOR / f"{name}_host.cpp"), str(EMULATOR / "cuda_host.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"host build failed:\n{done.stderr[-4000:]}"
    return exe


def walk_statuses(monkeypatch, name: str = "tma") -> tuple[str | None, str | None]:
    """attention_flash.tma_status() (name "lookahead": lookahead_status()) without its variable
    (WARMSTATE_FLASH_TMA, WARMSTATE_FLASH_LOOKAHEAD) and with it set to 1, each decided afresh
    (the cache cleared before, between and after)."""
    from executor.numba_cuda import attention_flash

    status, variable = getattr(attention_flash, f"{name}_status"), f"WARMSTATE_FLASH_{name.upper()}"
    monkeypatch.delenv(variable, raising=False)
    status.cache_clear()
    try:
        off = status()
        monkeypatch.setenv(variable, "1")
        status.cache_clear()
        return off, status()
    finally:
        status.cache_clear()
