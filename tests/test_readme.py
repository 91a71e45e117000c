"""The README's Quick start stays true: CI runs exactly its test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert "pip install -e . && python -m sim run" in readme
    assert "pip install -e '.[dev]' && python -m pytest -q -n 2" in readme
    assert "pip install -e '.[dev]'" in ci and "python -m pytest -q -n 2" in ci


def test_policy_demo_prints_the_three_turns():
    out = subprocess.run([sys.executable, "-m", "policy"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "turn 1: 3000 rows" in out.stdout and "turn 2: 4100 rows" in out.stdout
    assert "turn 3: 9000 rows" in out.stdout
    assert "resumes at            row 3397" in out.stdout


def test_quick_start_output_is_what_sim_run_prints():
    """The README's `python -m sim run` block is the simulator's current output (deterministic)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("workload mixed (seed 0, 150 conversations)", 1)[1].split("```", 1)[0]
    out = subprocess.run([sys.executable, "-m", "sim", "run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    for line in block.strip().splitlines()[1:]:
        if line == "...":
            continue
        key = line.split()[0]
        if key == "invariants":
            assert line.rsplit(";", 1)[0] == printed[key].rsplit(";", 1)[0]  # the wall time varies
        else:
            assert printed[key] == line, (key, printed[key], line)
