"""The Triton kernel runs under Triton's CPU interpreter when no GPU is present, and the tests import their
checkpoint writer (``int4_checkpoints``) from this folder (the suite runs with --import-mode=importlib).

TRITON_INTERPRET must be set before the kernel is decorated (first import of
``pagoda_quant_gptq_awq.triton_kernel``), hence at conftest import time.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
