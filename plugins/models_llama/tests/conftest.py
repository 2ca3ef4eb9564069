"""The suite runs with --import-mode=importlib, which leaves sys.path alone: make the test helpers importable."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
