"""cpu_paged depends on core's public interfaces only: no other plugin's package imported, none required."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]
OWN = "pagoda_attn_cpu"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_imports_no_other_plugin() -> None:
    sources = sorted((PLUGIN / "src" / OWN).rglob("*.py"))
    assert sources
    foreign = {
        f"{path.name}: {name}"
        for path in sources
        for name in _imported_modules(path)
        if name.split(".")[0].startswith("pagoda_") and name.split(".")[0] != OWN
    }
    assert not foreign, f"cpu_paged imports other distributions' code: {sorted(foreign)}"


def test_requires_no_other_plugin() -> None:
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    required = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert required == {"pagoda-core", "torch"}
