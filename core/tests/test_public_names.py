"""Every exported name resolves: ``pagoda``'s lazy top-level names and each core module's ``__all__``."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_top_level_names_resolve_and_import_pagoda_stays_cheap() -> None:
    out = _run("""
        import sys
        import pagoda
        assert "torch" not in sys.modules, "import pagoda pulled in torch"
        missing = []
        for name in pagoda.__all__:
            try:
                getattr(pagoda, name)
            except Exception as exc:
                missing.append(f"{name}: {exc!r}")
        print("\\n".join(missing))
    """)
    assert out.strip() == "", out


def test_every_core_module_imports_and_its_all_resolves() -> None:
    out = _run("""
        import importlib, pkgutil
        import pagoda
        problems = []
        for info in pkgutil.walk_packages(pagoda.__path__, "pagoda."):
            try:
                module = importlib.import_module(info.name)
            except Exception as exc:
                problems.append(f"{info.name}: {exc!r}")
                continue
            problems += [f"{info.name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
        print("\\n".join(problems))
    """)
    assert out.strip() == "", out
