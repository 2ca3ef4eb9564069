"""The suite runs with --import-mode=importlib, which leaves sys.path alone: make the shared
batch builder and dense reference of the torch_paged tests importable."""

import sys
from pathlib import Path

_TORCH_PAGED_TESTS = str(Path(__file__).resolve().parents[2] / "attn_torch" / "tests")
if _TORCH_PAGED_TESTS not in sys.path:
    sys.path.insert(0, _TORCH_PAGED_TESTS)
