"""executor/ (outside numba_cuda/) imports no GPU code and no dev-only packages."""

from __future__ import annotations

import ast
from pathlib import Path

import executor

FORBIDDEN = ("numba", "torch", "transformers", "sim")


def test_no_forbidden_imports():
    root = Path(executor.__file__).parent
    for path in root.rglob("*.py"):
        if "numba_cuda" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.relative_to(root)} imports {name}"
