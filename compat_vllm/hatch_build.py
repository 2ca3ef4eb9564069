"""Build hook: refuse to build where a real vLLM distribution is installed.

A wheel has no install-time code, so this is the one point at which an install from source can
still say no before pip writes into a folder a real vLLM owns. The check itself is the package's
own (``vllm/_pagoda_guard.py``), loaded by path: importing ``vllm`` here could import the real one.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _guard() -> Any:
    path = Path(__file__).parent / "src" / "vllm" / "_pagoda_guard.py"
    spec = importlib.util.spec_from_file_location("_pagoda_vllm_guard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # pip's build isolation hides the target environment's site-packages from sys.path, but the
        # interpreter's install scheme still names them: look there as well as on sys.path.
        paths = sysconfig.get_paths()
        places = [paths["purelib"], paths["platlib"], *sys.path]
        real = _guard().real_vllm_distributions(places)
        if real:
            raise RuntimeError(_guard().refusal(real, "install"))
