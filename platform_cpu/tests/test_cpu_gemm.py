"""pagoda's packed AVX-512 matmul against F.linear, and the platform's choice of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda_platform_cpu import gemm as gemm_module
from pagoda_platform_cpu.gemm import PackedGemmKernel
from pagoda_platform_cpu.linear import GemvLinearKernel
from pagoda_platform_cpu.platform import GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, CpuPlatform, cpu_flags

DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(
            gemm_module.unavailable_reason(dtype) is not None, reason=f"{gemm_module.unavailable_reason(dtype)}"
        ),
    )
    for dtype in (torch.float32, torch.bfloat16)
]


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    """fp32: F.linear's result up to summation order. bf16: one rounding of a float32 sum, within an ulp or two."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
        return
    tol = 2 * 2.0**-8 * ref.abs() + 1e-3 * ref.abs().max()
    assert bool(((out.float() - ref).abs() <= tol).all()), (out.float() - ref).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 31, 64, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 33), (31, 7), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(dtype: torch.dtype, rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    """Every row-tile tail (1-7 rows past a multiple of 8), partial column panels and an odd K."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    kernel = PackedGemmKernel()
    _check(x, w, b, kernel.apply(x, kernel.prepare(w), b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_tile", [12, 14])
def test_taller_row_tiles_match_f_linear(dtype: torch.dtype, row_tile: int) -> None:
    """The tiles a CPU may be tuned to: whole tiles, an 8-row tile plus a short one, and short tails alone."""
    g = torch.Generator().manual_seed(row_tile)
    kernel = PackedGemmKernel(row_tile=row_tile)
    for out_features, in_features in [(96, 64), (50, 33)]:
        w = torch.randn(out_features, in_features, generator=g).to(dtype)
        b = torch.randn(out_features, generator=g).to(dtype)
        prepared = kernel.prepare(w)
        for rows in [1, 7, 9, row_tile - 1, row_tile, row_tile + 1, row_tile + 8, row_tile + 11, 3 * row_tile + 5]:
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            _check(x, w, b, kernel.apply(x, prepared, b))
    with pytest.raises(ValueError, match="row_tile"):
        PackedGemmKernel(row_tile=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_tile", [8, 14])
def test_rows_in_blocks_past_half_of_l2(dtype: torch.dtype, row_tile: int) -> None:
    """x larger than half of L2 runs in row blocks: several blocks and a short last one, strided x, bias."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 1536, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    kernel = PackedGemmKernel(row_tile=row_tile)
    prepared = kernel.prepare(w)
    wide = torch.randn(1203, 1600, generator=g).to(dtype)  # 1203 x 1536 bf16 is 3.7 MB, fp32 7.4 MB
    x = wide[:, 3:1539]
    _check(x, w, b, kernel.apply(x, prepared, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_batched_inputs_and_no_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g).to(dtype)
    kernel = PackedGemmKernel()
    prepared = kernel.prepare(w)
    wide = torch.randn(5, 60, generator=g).to(dtype)
    strided = wide[:, 10:34]  # rows 60 elements apart
    _check(strided, w, None, kernel.apply(strided, prepared, None))
    cols = torch.randn(24, 5, generator=g).to(dtype).t()  # last dim not contiguous
    _check(cols, w, None, kernel.apply(cols, prepared, None))
    batched = torch.randn(2, 3, 24, generator=g).to(dtype)
    out = kernel.apply(batched, prepared, None)
    assert out.shape == (2, 3, 40)
    _check(batched.reshape(6, 24), w, None, out.reshape(6, 40))
    assert kernel.apply(torch.empty(0, 24, dtype=dtype), prepared, None).shape == (0, 40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_propagate(dtype: torch.dtype) -> None:
    """inf and NaN in x reach exactly the outputs they touch; the zero padding never adds a NaN."""
    w = torch.ones(33, 5, dtype=dtype)
    x = torch.zeros(3, 5, dtype=dtype)
    x[1, 4] = float("inf")  # for bf16 the lone last k of an odd K
    x[2, 0] = float("nan")
    kernel = PackedGemmKernel()
    out = kernel.apply(x, kernel.prepare(w), None)
    assert bool((out[0] == 0).all())
    assert bool(torch.isinf(out[1]).all())
    assert bool(torch.isnan(out[2]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_refuses_what_does_not_fit(dtype: torch.dtype) -> None:
    kernel = PackedGemmKernel()
    prepared = kernel.prepare(torch.zeros(40, 24, dtype=dtype))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.apply(torch.zeros(2, 26, dtype=dtype), prepared, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.apply(torch.zeros(2, 24, dtype=dtype), prepared, torch.zeros(39, dtype=dtype))
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="x's dtype"):
        kernel.apply(torch.zeros(2, 24, dtype=other), prepared, None)
    assert not kernel.supports(torch.zeros(4, 4, dtype=torch.float16))
    assert gemm_module.unavailable_reason(torch.float16) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_platform_runs_linears_on_it_unless_turned_off(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (PACKED_LINEAR_ENV, GEMV_ENV, GEMM_ENV):
        monkeypatch.delenv(name, raising=False)
    platform = CpuPlatform()
    kernel = platform.linear_kernel(dtype)
    assert isinstance(kernel, PackedGemmKernel) and kernel.dtypes == (dtype,)
    monkeypatch.setenv(GEMM_ENV, "0")
    assert isinstance(platform.linear_kernel(dtype), GemvLinearKernel)


def test_without_the_instructions_linears_keep_the_gemv_and_onednn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in (PACKED_LINEAR_ENV, GEMV_ENV, GEMM_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gemm_module, "unavailable_reason", lambda dtype: "this CPU has no AVX-512F")
    with caplog.at_level(logging.INFO, logger="pagoda_platform_cpu.platform"):
        kernel = CpuPlatform().linear_kernel(torch.float32)
    assert not isinstance(kernel, PackedGemmKernel)
    assert "no AVX-512F" in caplog.text


@pytest.mark.parametrize(
    ("flags", "supported"),
    # -march=native stays: without BF16 the float32 path is there only where this CPU has AVX-512F
    [(["-mno-avx512f"], (False, False)), (["-mno-avx512bf16"], ("avx512f" in cpu_flags(), False))],
    ids=["avx2", "avx512_no_bf16"],
)
def test_source_builds_for_cpus_without_the_instructions(flags: list[str], supported: tuple[bool, bool], tmp_path: Path) -> None:
    """The AVX-512 paths sit behind #if: the library must still build where they do not, and say what it lacks.

    Built and loaded, not just parsed: a target-specific intrinsic outside its #if fails only in code generation.
    """
    import ctypes
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    library = ctypes.CDLL(str(gemm_module.EXTENSION.compile_to(tmp_path / "libgemm.so", flags)))
    assert (bool(library.pagoda_gemm_supports(0)), bool(library.pagoda_gemm_supports(1))) == supported


@pytest.mark.parametrize("dtype", DTYPES)
def test_calls_learn_their_order_and_the_next_weight_changes_no_result(dtype: torch.dtype) -> None:
    """Each call is told the weight that followed it last time (its first panels are prefetched): the
    order is the order of the calls, and results are bit for bit those of a call told nothing."""
    g = torch.Generator().manual_seed(5)
    shapes = [(96, 64), (576, 1536), (50, 33)]  # other K and panel counts: each thread's first panel differs
    weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes]
    kernel = PackedGemmKernel()
    prepared = [kernel.prepare(w) for w in weights]
    for rows in (2, 8, 40, 300):
        xs = [torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes]
        for _ in range(2):  # the second round runs with what the first one taught
            outs = [kernel.apply(x, p, None) for x, p in zip(xs, prepared)]
        for a, b in zip(prepared, prepared[1:] + prepared[:1]):
            assert kernel._followers[a.data_ptr] is b
        for x, w, out in zip(xs, weights, outs):
            plain = PackedGemmKernel()  # knows no order
            assert torch.equal(out, plain.apply(x, plain.prepare(w), None))
            _check(x, w, None, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 32, 77, 300])
@pytest.mark.parametrize(("intermediate", "in_features", "with_bias"), [(1536, 576, False), (40, 33, True), (16, 64, False), (8, 7, True)])
def test_silu_and_mul_epilogue_is_the_separate_ops_bit_for_bit(dtype: torch.dtype, rows: int, intermediate: int,
                                                                in_features: int, with_bias: bool) -> None:
    """The fused gate/up projection equals the projection then the layer ops' silu_and_mul exactly: widths
    not a multiple of 16 (a partial last panel), odd K, bias, every row-tile tail."""
    from pagoda_platform_cpu.layer_ops import cpu_layer_ops

    g = torch.Generator().manual_seed(rows + intermediate + in_features)
    w = torch.randn(2 * intermediate, in_features, generator=g).to(dtype)
    b = torch.randn(2 * intermediate, generator=g).to(dtype) if with_bias else None
    x = (3 * torch.randn(rows, in_features, generator=g)).to(dtype)
    kernel = PackedGemmKernel()
    fused = kernel.apply_silu_and_mul(x, kernel.prepare_silu_and_mul(w), b)
    separate = cpu_layer_ops().silu_and_mul(kernel.apply(x, kernel.prepare(w), b))
    assert fused.shape == (rows, intermediate) and fused.dtype == dtype
    assert torch.equal(fused, separate)


@pytest.mark.skipif(gemm_module.unavailable_reason(torch.float32) is not None, reason="no float32 packed matmul here")
def test_silu_and_mul_epilogue_refuses_what_it_cannot_take() -> None:
    kernel = PackedGemmKernel()
    assert not kernel.supports_silu_and_mul(torch.randn(7, 4))  # no gate/up halves
    with pytest.raises(RuntimeError, match="even number of rows"):
        kernel.prepare_silu_and_mul(torch.randn(7, 4))
    with pytest.raises(RuntimeError, match="prepare_silu_and_mul"):
        kernel.apply_silu_and_mul(torch.randn(2, 4), kernel.prepare(torch.randn(8, 4)), None)
    with pytest.raises(RuntimeError, match="bias of \\[8\\]"):
        kernel.apply_silu_and_mul(torch.randn(2, 4), kernel.prepare_silu_and_mul(torch.randn(8, 4)), torch.randn(4))
