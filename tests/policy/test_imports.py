"""policy/ is pure Python: it imports no numpy, numba, sim or executor (DESIGN "Layout")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "policy"
FORBIDDEN = ("numpy", "numba", "sim", "executor")
MODULES = sorted(
    "policy" if p.name == "__init__.py" else f"policy.{p.stem}"
    for p in POLICY.glob("*.py")
    if p.name != "__main__.py"
)


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_policy_loads_no_numpy():
    assert _python("import policy, sys; print('numpy' in sys.modules)") == "False"


def test_every_policy_module_loads_no_forbidden_package():
    assert len(MODULES) >= 10, MODULES
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))\n"
    )
    assert _python(code) == "[]"


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            roots.update(a.value.split(".")[0] for a in node.args[:1] if isinstance(a, ast.Constant))
    return roots


@pytest.mark.parametrize("path", sorted(POLICY.glob("*.py")), ids=lambda p: p.name)
def test_no_forbidden_import_in_source(path):
    bad = _imported_roots(path) & set(FORBIDDEN)
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_ast_check_sees_imports_inside_functions(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    import numpy as np\n    from sim.loop import x\n    __import__('numba')\n")
    assert _imported_roots(planted) >= {"numpy", "sim", "numba"}
