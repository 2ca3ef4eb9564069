"""The Triton kernel's tests run it under Triton's CPU interpreter when no GPU is present.

Must happen before ``pagoda_quant_compressed_tensors.triton_kernels`` is first imported (its kernels are
decorated then); on a GPU machine the compiled kernel runs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
