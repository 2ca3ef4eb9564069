"""The CPU platform's hybrid linear kernel: the GEMV for a few rows, the packed matmul (or F.linear) above."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import Linear, LinearKernel, prepare_linear_layers
from pagoda_platform_cpu import gemv as gemv_module
from pagoda_platform_cpu.linear import (
    GEMV_MAX_ROWS,
    GemvLinearKernel,
    GemvPrepared,
    OneDNNLinearKernel,
    onednn_available,
)
from pagoda_platform_cpu.platform import GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, CpuPlatform

pytestmark = pytest.mark.skipif(gemv_module.build_failure() is not None, reason="the GEMV extension cannot be built here")


class RecordingPacker(OneDNNLinearKernel):
    def __init__(self) -> None:
        super().__init__()
        self.applied: list[int] = []

    def apply(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        self.applied.append(x.shape[0])
        return super().apply(x, prepared, bias)


def _recording_kernel(packer: OneDNNLinearKernel | None, **kwargs: Any) -> tuple[GemvLinearKernel, list[int]]:
    kernel = GemvLinearKernel(packer, **kwargs)
    gemv_rows: list[int] = []
    inner = kernel._gemv

    def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        gemv_rows.append(x.shape[0])
        return inner(x, w, b)

    kernel._gemv = gemv
    return kernel, gemv_rows


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_pick_the_path(dtype: torch.dtype) -> None:
    packer = RecordingPacker()
    kernel, gemv_rows = _recording_kernel(packer, max_rows=3)
    assert isinstance(kernel, LinearKernel)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    prepared = kernel.prepare(w)
    assert prepared.packed is not None
    for rows in (1, 2, 3, 4, 9):
        x = torch.randn(rows, 24, generator=g).to(dtype)
        out = kernel.apply(x, prepared, b)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=5e-2 if dtype == torch.bfloat16 else 1e-5)
    assert gemv_rows == [1, 2, 3]
    assert packer.applied == [4, 9]


@needs_onednn
def test_packed_copies_stop_at_the_budget_and_the_rest_use_gemv_then_f_linear() -> None:
    packer = RecordingPacker()
    w1, w2 = torch.randn(16, 8), torch.randn(32, 8)
    kernel, gemv_rows = _recording_kernel(packer, max_rows=2, max_rows_unpacked=4, packed_budget_bytes=w1.numel() * 4)
    p1, p2 = kernel.prepare(w1), kernel.prepare(w2)
    assert p1.packed is not None and p2.packed is None
    assert kernel.packed_bytes == w1.numel() * 4 and kernel.unpacked_layers == 1
    x = torch.randn(5, 8)
    torch.testing.assert_close(kernel.apply(x, p2, None), F.linear(x, w2))  # F.linear past max_rows_unpacked
    assert packer.applied == [] and gemv_rows == []
    torch.testing.assert_close(kernel.apply(x[:4], p2, None), F.linear(x[:4], w2), rtol=1e-5, atol=1e-5)
    assert gemv_rows == [4], "a layer without a packed copy keeps the GEMV up to max_rows_unpacked"
    kernel.apply(x[:3], p1, None)
    assert packer.applied == [3], "a packed layer leaves the GEMV at max_rows"


def test_without_a_packer_large_inputs_use_f_linear() -> None:
    kernel, gemv_rows = _recording_kernel(None, max_rows=1, max_rows_unpacked=2)
    assert kernel.name == "gemv+f_linear"
    w = torch.randn(12, 6)
    prepared = kernel.prepare(w)
    assert prepared.packed is None
    x = torch.randn(3, 6)
    torch.testing.assert_close(kernel.apply(x, prepared, None), F.linear(x, w))
    torch.testing.assert_close(kernel.apply(x[:2], prepared, None), F.linear(x[:2], w), rtol=1e-5, atol=1e-5)
    assert gemv_rows == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_head_reads_the_shared_weight_in_place(dtype: torch.dtype) -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16, dtype=dtype)
            self.proj = Linear(16, 16, True, dtype)
            self.head = Linear(16, 50, False, dtype)
            self.head.weight = self.embed.weight  # tied

    model = Tiny()
    with torch.no_grad():
        model.proj.weight.normal_()
        model.proj.bias.normal_()
    proj_weight = model.proj.weight.detach().clone()
    x = torch.randn(1, 16).to(dtype)
    want_head = F.linear(x.double(), model.embed.weight.double()).to(dtype)
    kernel = GemvLinearKernel(OneDNNLinearKernel() if onednn_available() else None)
    assert prepare_linear_layers(model, kernel) == 2
    prepared: GemvPrepared = model.head.prepared
    assert prepared.weight.data_ptr() == model.embed.weight.data_ptr(), "the tied weight is read, not copied"
    assert model.head.weight is model.embed.weight
    assert model.proj.weight.numel() == 0, "the layer's own parameter is released; the kernel holds the weight"
    tol = {"rtol": 1e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(model.head(x), want_head, **tol)
    torch.testing.assert_close(model.proj(x).float(), F.linear(x.float(), proj_weight.float(), model.proj.bias.float()), **tol)
    # many rows through the other path agree with the GEMV rows
    xs = torch.randn(8, 16).to(dtype)
    torch.testing.assert_close(model.head(xs)[:1], model.head(xs[:1]), **tol)


def test_platform_chooses_the_gemv_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = CpuPlatform()
    monkeypatch.delenv(PACKED_LINEAR_ENV, raising=False)
    monkeypatch.delenv(GEMV_ENV, raising=False)
    monkeypatch.setenv(GEMM_ENV, "0")  # the packed AVX-512 matmul takes both dtypes where the CPU has it
    for dtype in (torch.float32, torch.bfloat16):
        kernel = platform.linear_kernel(dtype)
        assert isinstance(kernel, GemvLinearKernel)
        assert kernel.max_rows == GEMV_MAX_ROWS[dtype]
    assert platform.linear_kernel(torch.float16) is None
    monkeypatch.setenv(GEMV_ENV, "0")
    assert not isinstance(platform.linear_kernel(torch.float32), GemvLinearKernel)
    monkeypatch.setenv(GEMV_ENV, "1")
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    assert platform.linear_kernel(torch.float32) is None, "PAGODA_CPU_PACKED_LINEAR=0 means plain F.linear"


@needs_onednn
def test_a_failed_build_falls_back_to_the_packed_kernel(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PACKED_LINEAR_ENV, raising=False)
    monkeypatch.delenv(GEMV_ENV, raising=False)
    monkeypatch.setenv(GEMM_ENV, "0")
    monkeypatch.setattr(gemv_module, "build_failure", lambda: "no compiler here")
    with caplog.at_level(logging.WARNING, logger="pagoda_platform_cpu.platform"):
        kernel = CpuPlatform().linear_kernel(torch.float32)
    assert kernel is not None and kernel.name == "onednn_packed"
    assert "no compiler here" in caplog.text
