"""Run the backend's Triton kernels under Triton's CPU interpreter when no GPU is present.

Must happen before pagoda_kernels' Triton modules are first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
