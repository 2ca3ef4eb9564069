"""The import direction inside core: executors and workers sit below the engine and never import it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pagoda

SRC = Path(pagoda.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["executor", "worker"])
def test_the_lower_layers_never_import_the_engine(package: str) -> None:
    files = sorted((SRC / package).glob("*.py"))
    assert files
    upward = {f"{p.relative_to(SRC)}: {m}" for p in files for m in _imported_modules(p)
              if m == "pagoda.engine" or m.startswith("pagoda.engine.")}
    assert upward == set()


def test_a_worker_process_imports_no_engine_module() -> None:
    # what an mp / ray worker process imports to start (pagoda.worker.process), in a fresh interpreter
    code = ("import sys, pagoda.executor.multiproc_executor, pagoda.worker.process, pagoda.worker.worker\n"
            "print(sorted(m for m in sys.modules if m.startswith('pagoda.engine')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
