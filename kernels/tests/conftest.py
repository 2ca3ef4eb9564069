"""Kernel tests run the Triton kernels under Triton's CPU interpreter.

TRITON_INTERPRET must be set before the kernels are decorated (first import of
``pagoda_kernels.triton_impl.*``), hence at conftest import time. Without a GPU
it defaults to on; with one it defaults to off so the ``gpu`` tests check the
compiled kernels (set TRITON_INTERPRET=1 explicitly to run the interpreted ones).
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# bf16: both paths compute in fp32 and round once at the end; allow ~1-2 bf16 ulps.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def _interpreted_kernels_ok() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "TRITON_INTERPRET is off for this run"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    loaded = [m for n, m in sys.modules.items() if n.startswith("pagoda_kernels.triton_impl.")]
    from triton.runtime.interpreter import InterpretedFunction

    for module in loaded:
        for value in vars(module).values():
            if hasattr(value, "run") and hasattr(value, "fn") and not isinstance(value, InterpretedFunction):
                return f"{module.__name__} was imported before TRITON_INTERPRET=1 was set"
    return None


@pytest.fixture
def interpreted() -> None:
    """Skip when the Triton kernels cannot run under the interpreter in this process."""
    reason = _interpreted_kernels_ok()
    if reason:
        pytest.skip(reason)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def tol(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES[dtype]
