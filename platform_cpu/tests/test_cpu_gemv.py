"""The CPU GEMV kernel against F.linear: this CPU's path, and the paths it does not take (AVX2, AVX-512 without BF16)."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda_platform_cpu import gemv as gemv_module
from pagoda_platform_cpu.linear import GEMV_MAX_ROWS, GEMV_MAX_ROWS_UNPACKED


@pytest.fixture(scope="module")
def gemv():
    failure = gemv_module.build_failure()
    if failure is not None:
        pytest.skip(failure)
    return gemv_module.gemv


def _case(rows: int, out: int, inner: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rows * 7 + out + inner)
    x = torch.randn(rows, inner, generator=g).to(dtype)
    w = torch.randn(out, inner, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return x, w, b


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_fp32_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    # fp32 accumulation in another order than F.linear's: relative to the sum of |products|
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert out.dtype == torch.float32
    assert ((out.double() - _exact(x, w, b)).abs() <= 1e-5 * scale + 1e-6).all()


def _assert_bf16_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    # bf16 products are exact in fp32, the sum is fp32, the result rounded once to bf16 (2^-8 relative)
    exact = _exact(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * scale).all()


SHAPES = [(96, 80), (33, 577), (7, 5), (130, 1536), (1, 31), (64, 47)]


@pytest.mark.parametrize("rows", list(range(1, max(GEMV_MAX_ROWS.values()) + 2)) + [9, GEMV_MAX_ROWS_UNPACKED])
@pytest.mark.parametrize(("out", "inner"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear(gemv, rows: int, out: int, inner: int, bias: bool) -> None:
    x, w, b = _case(rows, out, inner, torch.float32, bias)
    y = gemv(x, w, b)
    assert y.shape == (rows, out)
    _assert_fp32_close(y, x, w, b)


@pytest.mark.parametrize("rows", list(range(1, max(GEMV_MAX_ROWS.values()) + 2)) + [9, GEMV_MAX_ROWS_UNPACKED])
@pytest.mark.parametrize(("out", "inner"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_within_one_rounding(gemv, rows: int, out: int, inner: int, bias: bool) -> None:
    x, w, b = _case(rows, out, inner, torch.bfloat16, bias)
    _assert_bf16_close(gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_and_batched_inputs(gemv, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 48, generator=g).to(dtype)
    wide = torch.randn(3, 96, generator=g).to(dtype)
    x = wide[:, 16:64]  # a strided view, as q/k/v slices of a fused projection are
    assert not x.is_contiguous()
    torch.testing.assert_close(gemv(x, w), gemv(x.contiguous(), w), rtol=0, atol=0)
    batched = torch.randn(2, 1, 48, generator=g).to(dtype)
    assert gemv(batched, w).shape == (2, 1, 70)
    torch.testing.assert_close(gemv(batched, w), gemv(batched.reshape(2, 48), w).reshape(2, 1, 70), rtol=0, atol=0)


def test_zero_rows_and_wrong_inputs(gemv) -> None:
    w = torch.randn(8, 4)
    assert gemv(torch.empty(0, 4), w).shape == (0, 8)
    with pytest.raises(RuntimeError, match="columns"):
        gemv(torch.randn(1, 5), w)
    with pytest.raises(RuntimeError, match="dtype"):
        gemv(torch.randn(1, 4, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gemv(torch.randn(1, 4, dtype=torch.float16), w.half())


def test_large_row_count_splits_over_threads(gemv) -> None:
    # enough weight bytes for every thread to get a share, and N not a multiple of anything
    x, w, b = _case(2, 4099, 576, torch.bfloat16, True, seed=3)
    _assert_bf16_close(gemv(x, w, b), x, w, b)
    x, w, b = _case(1, 4099, 576, torch.float32, True, seed=4)
    _assert_fp32_close(gemv(x, w, b), x, w, b)


# -- the paths this CPU does not take, compiled with other -m flags and called through the C ABI ----------


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def _host_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _build_standalone(tmp_path: Path, name: str, extra_flags: list[str]) -> ctypes.CDLL:
    library = gemv_module.EXTENSION.compile_to(tmp_path / f"libgemv_{name}.so", extra_flags)
    lib = ctypes.CDLL(str(library))
    lib.pagoda_gemv_isa.restype = ctypes.c_char_p
    return lib


def _call(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    fn = lib.pagoda_gemv_f32 if x.dtype == torch.float32 else lib.pagoda_gemv_bf16
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    ptr = ctypes.c_void_p
    fn(ptr(x.data_ptr()), ptr(w.data_ptr()), ptr(b.data_ptr() if b is not None else 0), ptr(y.data_ptr()),
       ctypes.c_int64(x.shape[0]), ctypes.c_int64(w.shape[0]), ctypes.c_int64(x.shape[1]), ctypes.c_int(2))
    return y


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or _compiler() is None, reason="needs an x86-64 C++ compiler")
@pytest.mark.parametrize(
    ("variant", "flags", "isa", "needs"),
    [
        ("avx2", ["-mno-avx512f"], "portable", set()),
        ("avx512_no_bf16", ["-mno-avx512bf16"], "avx512", {"avx512f"}),
    ],
)
def test_paths_other_cpus_take(tmp_path: Path, variant: str, flags: list[str], isa: str, needs: set[str]) -> None:
    if not needs <= _host_flags():
        pytest.skip(f"the host lacks {needs - _host_flags()}")
    lib = _build_standalone(tmp_path, variant, flags)
    assert lib.pagoda_gemv_isa().decode() == isa
    for rows in (1, 2, 3, 5):
        for out, inner in SHAPES:
            for bias in (False, True):
                x, w, b = _case(rows, out, inner, torch.float32, bias, seed=1)
                _assert_fp32_close(_call(lib, x, w, b), x, w, b)
                x, w, b = _case(rows, out, inner, torch.bfloat16, bias, seed=2)
                _assert_bf16_close(_call(lib, x, w, b), x, w, b)
