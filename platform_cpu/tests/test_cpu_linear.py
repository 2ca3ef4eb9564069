"""The CPU platform's packed oneDNN linear kernel against F.linear."""

from __future__ import annotations

import pytest
import torch

from pagoda_platform_cpu.linear import OneDNNLinearKernel, onednn_available
from pagoda_platform_cpu.platform import GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, CpuPlatform

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 80, generator=g)
    kernel = OneDNNLinearKernel()
    assert kernel.supports(w)
    out = kernel.apply(x, kernel.prepare(w), b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float(), rtol=1e-5, atol=1e-5)


def test_bfloat16_within_bf16_rounding_and_strided_input() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    wide = torch.randn(10, 96, generator=g).to(torch.bfloat16)
    x = wide[:, :48]  # a strided view, as q/k/v slices of a fused projection are
    kernel = OneDNNLinearKernel()
    out = kernel.apply(x, kernel.prepare(w), None)
    assert out.dtype == torch.bfloat16 and out.shape == (10, 64)
    exact = x.double() @ w.double().T
    # one bf16 rounding of the fp32-accumulated result: 2^-8 relative
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-2).all()


def test_platform_offers_the_kernel_for_fp32_and_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = CpuPlatform()
    monkeypatch.delenv(PACKED_LINEAR_ENV, raising=False)
    monkeypatch.setenv(GEMV_ENV, "0")
    monkeypatch.setenv(GEMM_ENV, "0")
    assert platform.linear_kernel(torch.float32).name == "onednn_packed"
    assert platform.linear_kernel(torch.bfloat16) is not None
    assert platform.linear_kernel(torch.float16) is None
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    assert platform.linear_kernel(torch.float32) is None
    assert not OneDNNLinearKernel().supports(torch.zeros(4, 4, dtype=torch.float16))


def test_bf16_weights_oneDNN_cannot_pack_here_are_packed_as_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a CPU without AVX512BW / AVX-NE-CONVERT, where oneDNN's bf16 packing raises
    from pagoda_platform_cpu import linear
    from pagoda_platform_cpu.linear import GemvLinearKernel, WidenedWeight

    real = linear._reorder

    def refuses_bf16(weight: torch.Tensor) -> object:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return real(weight)

    monkeypatch.setattr(linear, "_reorder", refuses_bf16)
    packer = OneDNNLinearKernel()
    assert packer.widened == (torch.bfloat16,)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    assert packer.supports(w)
    prepared = packer.prepare(w)
    assert isinstance(prepared, WidenedWeight)
    x = torch.randn(9, 32, generator=g).to(torch.bfloat16)
    out = packer.apply(x, prepared, b)
    # float32 accumulation of exact bf16 products, rounded once: what a bf16 matmul with float32 accumulation gives
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert (out.double() - exact.double()).abs().max() <= exact.double().abs().max() * 2**-8
    # the GEMV kernel keeps the widened copy and answers every row count
    kernel = GemvLinearKernel(packer, max_rows=4)
    prepared = kernel.prepare(w)
    assert isinstance(prepared.packed, WidenedWeight)
    assert kernel.packed_bytes == 48 * 32 * 4  # the float32 copy counts against the packed budget
    for rows in (1, 4, 17, 40):
        x = torch.randn(rows, 32, generator=g).to(torch.bfloat16)
        torch.testing.assert_close(kernel.apply(x, prepared, None).float(),
                                   torch.nn.functional.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)
