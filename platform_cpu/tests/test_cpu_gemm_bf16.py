"""pagoda's AVX512_BF16 matmul against F.linear, and the platform's choice of it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagoda_platform_cpu import gemm as gemm_module
from pagoda_platform_cpu.gemm import Bf16GemmKernel
from pagoda_platform_cpu.linear import GemvLinearKernel
from pagoda_platform_cpu.platform import BF16_GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, CpuPlatform

needs_bf16_gemm = pytest.mark.skipif(
    gemm_module.unavailable_reason() is not None, reason=f"AVX512_BF16 matmul unavailable: {gemm_module.unavailable_reason()}"
)


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    """One bf16 rounding of a float32 sum: within an ulp or two of the float32 reference, however ordered."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    tol = 2 * 2.0**-8 * ref.abs() + 1e-3 * ref.abs().max()
    assert bool(((out.float() - ref).abs() <= tol).all()), (out.float() - ref).abs().max()


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 31, 64, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 33), (31, 7), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    """Every row-tile tail (1-7 rows past a multiple of 8), partial column panels and an odd K."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    kernel = Bf16GemmKernel()
    _check(x, w, b, kernel.apply(x, kernel.prepare(w), b))


@needs_bf16_gemm
def test_strided_and_batched_inputs_and_no_rows() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    kernel = Bf16GemmKernel()
    prepared = kernel.prepare(w)
    wide = torch.randn(5, 60, generator=g).to(torch.bfloat16)
    strided = wide[:, 10:34]  # rows 60 elements apart
    _check(strided, w, None, kernel.apply(strided, prepared, None))
    cols = torch.randn(24, 5, generator=g).to(torch.bfloat16).t()  # last dim not contiguous
    _check(cols, w, None, kernel.apply(cols, prepared, None))
    batched = torch.randn(2, 3, 24, generator=g).to(torch.bfloat16)
    out = kernel.apply(batched, prepared, None)
    assert out.shape == (2, 3, 40)
    _check(batched.reshape(6, 24), w, None, out.reshape(6, 40))
    assert kernel.apply(torch.empty(0, 24, dtype=torch.bfloat16), prepared, None).shape == (0, 40)


@needs_bf16_gemm
def test_special_values_propagate() -> None:
    """inf and NaN in x reach exactly the outputs they touch; the zero padding never adds a NaN."""
    w = torch.ones(33, 5, dtype=torch.bfloat16)
    x = torch.zeros(3, 5, dtype=torch.bfloat16)
    x[1, 4] = float("inf")  # the lone last k of an odd K
    x[2, 0] = float("nan")
    kernel = Bf16GemmKernel()
    out = kernel.apply(x, kernel.prepare(w), None)
    assert bool((out[0] == 0).all())
    assert bool(torch.isinf(out[1]).all())
    assert bool(torch.isnan(out[2]).all())


@needs_bf16_gemm
def test_refuses_mismatched_shapes() -> None:
    kernel = Bf16GemmKernel()
    prepared = kernel.prepare(torch.zeros(40, 24, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.apply(torch.zeros(2, 26, dtype=torch.bfloat16), prepared, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.apply(torch.zeros(2, 24, dtype=torch.bfloat16), prepared, torch.zeros(39, dtype=torch.bfloat16))
    assert not kernel.supports(torch.zeros(4, 4))


@needs_bf16_gemm
def test_platform_runs_bf16_linears_on_it_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (PACKED_LINEAR_ENV, GEMV_ENV, BF16_GEMM_ENV):
        monkeypatch.delenv(name, raising=False)
    platform = CpuPlatform()
    assert isinstance(platform.linear_kernel(torch.bfloat16), Bf16GemmKernel)
    assert isinstance(platform.linear_kernel(torch.float32), GemvLinearKernel)
    monkeypatch.setenv(BF16_GEMM_ENV, "0")
    assert isinstance(platform.linear_kernel(torch.bfloat16), GemvLinearKernel)


def test_without_the_kernel_bf16_keeps_onednn(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in (PACKED_LINEAR_ENV, GEMV_ENV, BF16_GEMM_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gemm_module, "unavailable_reason", lambda: "this CPU has no AVX512_BF16")
    monkeypatch.setattr("pagoda_platform_cpu.platform.has_native_bf16", lambda: True)
    with caplog.at_level(logging.WARNING, logger="pagoda_platform_cpu.platform"):
        kernel = CpuPlatform().linear_kernel(torch.bfloat16)
    packer = kernel.packer if isinstance(kernel, GemvLinearKernel) else kernel
    assert packer is None or packer.name == "onednn_packed"
    assert "no AVX512_BF16" in caplog.text
