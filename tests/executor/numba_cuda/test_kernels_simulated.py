"""Every numba-cuda kernel against its NumPy twin under the CUDA simulator (no GPU).

NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported, and must not leak
into other tests (or into the GPU tests of this folder), so each cases file runs in its
own pytest subprocess with the variable set there only. On a GPU machine, run the cases
files directly (`pytest tests/executor/numba_cuda/cases_*.py`) to check the real kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
CASES = sorted(p.name for p in HERE.glob("cases_*.py"))


@pytest.mark.parametrize("cases", CASES)
def test_kernels_under_simulator(cases):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(HERE / cases)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cases} failed under the simulator:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"


def test_every_kernel_module_has_cases():
    """Each kernel module of executor/numba_cuda is exercised by some cases file."""
    sources = "".join((HERE / c).read_text() for c in CASES)
    kernel_modules = ["attention", "attention_flash", "attention_mm", "attention_prep", "conv", "delta_chunked", "delta_mma", "delta_rule", "elementwise",
                      "gemv", "greedy", "norms"]
    missing = [m for m in kernel_modules if f" {m}" not in sources and f"{m}," not in sources]
    assert not missing, f"no cases for {missing}"
