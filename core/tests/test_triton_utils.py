"""pagoda.triton_utils: where a quantization method's Triton kernel serves an input."""

from __future__ import annotations

import pytest
import torch

from pagoda import triton_utils


@pytest.fixture
def triton_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_utils, "triton_available", lambda: True)
    monkeypatch.delenv("PAGODA_KERNELS_IMPL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.usefixtures("triton_installed")
def test_cpu_tensors_take_triton_only_when_asked_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 8)
    assert not triton_utils.triton_serves(x) and not triton_utils.triton_asked_on_cpu()
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    assert not triton_utils.triton_serves(x)  # asked, but compiled Triton has no CPU target
    for off in ("", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", off)
        assert not triton_utils.triton_interpreting() and not triton_utils.triton_serves(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_utils.triton_asked_on_cpu() and triton_utils.triton_serves(x)
    assert triton_utils.triton_serves(x.bfloat16()) and triton_utils.triton_serves(x.half())
    assert not triton_utils.triton_serves(x.to(torch.int8))  # the kernels take floating-point inputs
    assert not triton_utils.triton_serves(x.double())
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "auto")
    assert not triton_utils.triton_serves(x)  # auto: Triton on GPU tensors only


@pytest.mark.usefixtures("triton_installed")
def test_gpu_tensors_take_triton_unless_torch_is_asked_for_or_triton_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 8, device="meta")
    # the choice reads only dtype and device type: a stand-in for a CUDA tensor checks it without a GPU
    cuda_like = type("CudaLike", (), {"dtype": torch.float16, "device": torch.device("cuda", 0)})()
    assert not triton_utils.triton_serves(x)  # neither a GPU nor the CPU interpreter
    assert triton_utils.triton_serves(cuda_like)
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "torch")
    assert not triton_utils.triton_serves(cuda_like)
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "auto")
    monkeypatch.setattr(triton_utils, "triton_available", lambda: False)
    assert not triton_utils.triton_serves(cuda_like) and not triton_utils.triton_asked_on_cpu()
