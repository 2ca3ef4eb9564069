"""The CPU platform's fused C++ layer ops against pagoda's torch reference (TorchLayerOps)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagoda.cpp_extension import ExtensionBuildError
from pagoda.layers import LayerOps, TorchLayerOps
from pagoda_platform_cpu import layer_ops as layer_ops_module
from pagoda_platform_cpu.layer_ops import CpuLayerOps, cpu_layer_ops
from pagoda_platform_cpu.platform import LAYER_OPS_ENV, CpuPlatform

REF = TorchLayerOps()
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 64, 300]
EPS = 1e-5


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return cpu_layer_ops()  # compiles once per machine; a build failure fails the module


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 within 1e-6 relative; bf16 within one rounding step, and bit-identical almost everywhere.

    The C++ kernels round where torch rounds, so a wrong rounding order shows up as many
    1-ulp differences; only the order of a float32 sum or an exp() ulp may (rarely) flip one.
    """
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-30)
    differing = (out != ref).sum().item()
    assert differing <= max(1, out.numel() // 1000), f"{differing}/{out.numel()} bf16 values differ"


def _weight(d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(d, generator=torch.Generator().manual_seed(seed))).to(dtype)


def test_is_a_layer_ops(ops: CpuLayerOps) -> None:
    assert isinstance(ops, LayerOps) and ops.name == "cpu_fused"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a vector tail in every row
def test_rms_norm(ops: CpuLayerOps, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, w = _randn(tokens, hidden, dtype=dtype, seed=tokens), _weight(hidden, dtype, 1)
    _assert_matches(ops.rms_norm(x, w, EPS), REF.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_over_heads_of_a_strided_view(ops: CpuLayerOps, dtype: torch.dtype, tokens: int) -> None:
    """Qwen3's q_norm / k_norm: [T, heads, head_dim] inside the fused QKV output."""
    qkv = _randn(tokens, (8 + 2 + 2) * 64, dtype=dtype, seed=tokens)
    q_heads = qkv[:, : 8 * 64].view(tokens, 8, 64)
    k_heads = qkv[:, 8 * 64 : 10 * 64].view(tokens, 2, 64)
    w = _weight(64, dtype, 2)
    for heads in (q_heads, k_heads):
        out = ops.rms_norm(heads, w, 1e-6)
        assert out.is_contiguous()
        _assert_matches(out, REF.rms_norm(heads, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 100])
def test_add_rms_norm_writes_the_sum_into_the_residual(ops: CpuLayerOps, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = _randn(tokens, hidden, dtype=dtype, seed=tokens)
    residual = _randn(tokens, hidden, dtype=dtype, seed=tokens + 1)
    w = _weight(hidden, dtype, 3)
    x_before, ref_normed, ref_sum = x.clone(), *REF.add_rms_norm(x, residual.clone(), w, EPS)
    normed, summed = ops.add_rms_norm(x, residual, w, EPS)
    assert summed is residual  # written in place, as LayerOps allows
    assert torch.equal(summed, ref_sum)  # one add, rounded to the dtype: exact
    assert torch.equal(x, x_before)  # x is never written
    _assert_matches(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_without_residual_returns_x_as_the_sum(ops: CpuLayerOps, dtype: torch.dtype) -> None:
    x, w = _randn(3, 576, dtype=dtype, seed=0), _weight(576, dtype, 4)
    normed, summed = ops.add_rms_norm(x, None, w, EPS)
    assert summed is x
    _assert_matches(normed, REF.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 100])
def test_silu_and_mul(ops: CpuLayerOps, dtype: torch.dtype, tokens: int, intermediate: int) -> None:
    gate_up = _randn(tokens, 2 * intermediate, dtype=dtype, seed=tokens, scale=4.0)
    _assert_matches(ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_a_strided_view_and_extreme_values(ops: CpuLayerOps, dtype: torch.dtype) -> None:
    wide = _randn(5, 2 * 40 + 7, dtype=dtype, seed=5, scale=4.0)
    gate_up = wide[:, : 2 * 40]
    gate_up[0, :12] = torch.tensor([-1e4, -150, -104, -88, -87, -20, 0, 20, 87, 89, 150, 1e4], dtype=dtype)
    _assert_matches(ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up))



def test_bf16_rounding_of_denormals_nans_and_zeros_is_torchs(ops: CpuLayerOps) -> None:
    """Stores round with vcvtneps2bf16 where the CPU has it; that instruction flushes denormals and
    keeps NaN payloads, so vectors holding either must take the exact integer path: the bits match
    torch's everywhere (NaN as 0x7FC0), in vectors mixing them with ordinary values and in plain ones."""
    rows, half = 6, 64
    gate = torch.ones(rows, half)  # silu(1) * up: the product's rounding decides the stored bits
    up = torch.randn(rows, half, generator=torch.Generator().manual_seed(3))
    special = torch.tensor([1e-39, -3e-40, 1e-45, 0.0, -0.0, float("nan"), float("inf"), -float("inf"),
                            1.17e-38, 5.9e-39, -1e-38, 2e-38])
    up[0, : special.numel()] = special  # one 16-lane vector with all of them
    up[2, 17] = float("nan")  # a lone one in an otherwise ordinary vector
    up[4, 40] = 2e-39
    gate_up = torch.cat([gate, up], dim=1).to(torch.bfloat16)
    out, ref = ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up)
    out_bits, ref_bits = out.view(torch.int16), ref.view(torch.int16)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert (out_bits[nan] == 0x7FC0).all()
    assert torch.equal(out_bits[~nan], ref_bits[~nan])


def _cos_sin(tokens: int, rot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A gathered [T, 1, rot/2] table, as RotaryEmbedding.cos_sin returns it."""
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    table = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return table.cos().to(dtype)[positions].unsqueeze(1), table.sin().to(dtype)[positions].unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (64, 32), (128, 100)])  # full and partial rotary
def test_rotary_in_place_on_the_fused_qkv_output(ops: CpuLayerOps, dtype: torch.dtype, tokens: int, head_dim: int, rot: int) -> None:
    q_heads, kv_heads = 9, 3
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens)
    cos, sin = _cos_sin(tokens, rot, dtype)
    expected = qkv.clone()
    REF.rotary_neox_(expected[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    ops.rotary_neox_(qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    # Elementwise products and sums rounded as torch rounds them: bit-identical, v untouched.
    assert torch.equal(qkv, expected)


def test_rotary_on_separately_strided_heads(ops: CpuLayerOps) -> None:
    """A head stride that is not head_dim (heads picked out of a wider layout)."""
    base = _randn(4, 6, 2, 32, dtype=torch.float32, seed=9)
    qk = base[:, :, 0, :]  # strides (384, 64, 1)
    cos, sin = _cos_sin(4, 32, torch.float32)
    expected = base.clone()
    REF.rotary_neox_(expected[:, :, 0, :], cos, sin)
    ops.rotary_neox_(qk, cos, sin)
    assert torch.equal(base, expected)


def test_uncovered_inputs_fall_back_to_torch_and_write_nothing(ops: CpuLayerOps) -> None:
    half_x = _randn(4, 64, dtype=torch.float16, seed=0)
    half_r = _randn(4, 64, dtype=torch.float16, seed=1)
    half_w = _weight(64, torch.float16, 2)
    r_before = half_r.clone()
    normed, summed = ops.add_rms_norm(half_x, half_r, half_w, EPS)
    assert torch.equal(half_r, r_before)  # the torch path does not write in place
    ref_normed, ref_sum = REF.add_rms_norm(half_x, half_r, half_w, EPS)
    assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_sum)
    assert torch.equal(ops.silu_and_mul(half_x), REF.silu_and_mul(half_x))

    x = _randn(64, 8, dtype=torch.float32, seed=3).t()  # last dim not contiguous
    w = _weight(64, torch.float32, 4)
    torch.testing.assert_close(ops.rms_norm(x, w, EPS), REF.rms_norm(x, w, EPS), rtol=0, atol=0)
    # mixed dtypes (weight in float32 for a bf16 input): torch's promotion rules decide
    xb = _randn(2, 64, dtype=torch.bfloat16, seed=5)
    assert torch.equal(ops.rms_norm(xb, w, EPS), REF.rms_norm(xb, w, EPS))

    qk = _randn(2, 3, 16, dtype=torch.float16, seed=6)
    cos, sin = _cos_sin(2, 16, torch.float16)
    expected = qk.clone()
    REF.rotary_neox_(expected, cos, sin)
    ops.rotary_neox_(qk, cos, sin)
    assert torch.equal(qk, expected)


def test_a_residual_whose_rows_share_memory_is_not_written_in_place(ops: CpuLayerOps) -> None:
    x = _randn(4, 64, dtype=torch.float32, seed=0)
    residual = _randn(1, 64, dtype=torch.float32, seed=1).expand(4, 64)  # one row seen four times
    before = residual.clone()
    w = _weight(64, torch.float32, 2)
    normed, summed = ops.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, before)
    ref_normed, ref_sum = REF.add_rms_norm(x, before, w, EPS)
    assert torch.equal(summed, ref_sum) and torch.equal(normed, ref_normed)


def test_inputs_that_need_autograd_fall_back(ops: CpuLayerOps) -> None:
    x = _randn(2, 32, dtype=torch.float32, seed=0).requires_grad_()
    w = _weight(32, torch.float32, 1)
    out = ops.rms_norm(x, w, EPS)
    assert out.grad_fn is not None  # torch's op, recorded for backward


def test_platform_offers_the_ops_for_fp32_and_bf16_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = CpuPlatform()
    monkeypatch.delenv(LAYER_OPS_ENV, raising=False)
    assert platform.layer_ops(torch.float32).name == "cpu_fused"
    assert platform.layer_ops(torch.bfloat16) is not None
    assert platform.layer_ops(torch.float16) is None
    monkeypatch.setenv(LAYER_OPS_ENV, "0")
    assert platform.layer_ops(torch.float32) is None


def test_a_failed_build_leaves_torch_ops_with_the_reason_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> CpuLayerOps:
        raise ExtensionBuildError("the C++ kernels of pagoda_cpu_layer_ops could not be compiled (no compiler)")

    monkeypatch.delenv(LAYER_OPS_ENV, raising=False)
    monkeypatch.setattr(layer_ops_module, "cpu_layer_ops", broken)
    with caplog.at_level(logging.WARNING):
        assert CpuPlatform().layer_ops(torch.float32) is None
    assert "no compiler" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx2_build_matches_torch(dtype: torch.dtype, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The 8-lane path (no AVX-512), built here with -mno-avx512f and called through its C entry points."""
    import ctypes
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    lib = ctypes.CDLL(str(layer_ops_module.EXTENSION.compile_to(tmp_path / "liblayer_ops_avx2.so", ["-mno-avx512f"])))
    p, i64, code = ctypes.c_void_p, ctypes.c_int64, 0 if dtype == torch.float32 else 1
    lib.pagoda_add_rms_norm.argtypes = [ctypes.c_int, p, i64, i64, i64, i64, i64, p, i64, i64, p, p, ctypes.c_float, ctypes.c_int]
    lib.pagoda_silu_and_mul.argtypes = [ctypes.c_int, p, i64, i64, i64, p, ctypes.c_int]
    x, residual = _randn(64, 100, dtype=dtype, seed=1), _randn(64, 100, dtype=dtype, seed=2)
    w = _weight(100, dtype, 3)
    ref_normed, ref_sum = REF.add_rms_norm(x, residual.clone(), w, EPS)
    out = torch.empty_like(x)
    assert lib.pagoda_add_rms_norm(code, x.data_ptr(), 64, 1, 100, 100, 0, residual.data_ptr(), 100, 0, w.data_ptr(), out.data_ptr(), EPS, 2) == 1
    assert torch.equal(residual, ref_sum)
    _assert_matches(out, ref_normed)
    gate_up = _randn(64, 2 * 100, dtype=dtype, seed=4, scale=4.0)
    out = torch.empty(64, 100, dtype=dtype)
    assert lib.pagoda_silu_and_mul(code, gate_up.data_ptr(), 64, 100, 200, out.data_ptr(), 2) == 1
    _assert_matches(out, REF.silu_and_mul(gate_up))
