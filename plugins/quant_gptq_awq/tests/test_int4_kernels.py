"""The formats' unpacking against hand-packed tensors, and the C++ and Triton kernels against the torch reference."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from int4_checkpoints import awq_tensors, gptq_tensors, quantize

from pagoda_quant_gptq_awq import cpu_kernel
from pagoda_quant_gptq_awq.formats import PackedCheckpoint, dequantize, group_index, unpack


def _checkpoint(fmt: str, n: int, k: int, group_size: int, act_order: bool = False, seed: int = 0,
                bits: int = 4) -> tuple[PackedCheckpoint, torch.Tensor]:
    """A random [n, k] weight quantized and packed as ``fmt``, with the float weight it stores."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // (k if group_size == -1 else group_size)
    qz = quantize(weight, group_size, g_idx, min_zero=1 if fmt == "gptq" else 0, bits=bits)
    tensors = gptq_tensors(qz, bits) if fmt == "gptq" else awq_tensors(qz)
    ckpt = PackedCheckpoint(fmt, tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),  # type: ignore[arg-type]
                          k if group_size == -1 else group_size, 1 if fmt == "gptq" else 0, k, n, bits)
    ckpt.validate("test")
    return ckpt, qz.dequantized


# -- formats ---------------------------------------------------------------------------------------

def test_awq_interleaved_order_by_hand() -> None:
    # one word holding nibbles 0..7 (lowest first): AWQ puts column c at nibble [0, 4, 1, 5, 2, 6, 3, 7][c]
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    from pagoda_quant_gptq_awq.formats import unpack_columns, unpack_rows

    assert unpack_columns(word, "awq").tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert unpack_columns(word, "gptq").tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_rows(word).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    # a word with the top bit set (negative as int32) unpacks the same bits
    assert unpack_rows(torch.tensor([[-0x10000000 + 0x0FEDCBA9]], dtype=torch.int32)).flatten().tolist() == \
        [9, 10, 11, 12, 13, 14, 15, 15]


@pytest.mark.parametrize("fmt,group_size,act_order", [("gptq", 32, False), ("gptq", -1, False), ("gptq", 16, True),
                                                      ("awq", 32, False), ("awq", -1, False)])
def test_reference_dequantize_equals_the_packed_weight(fmt: str, group_size: int, act_order: bool) -> None:
    ckpt, expected = _checkpoint(fmt, 48, 64, group_size, act_order)
    assert torch.equal(dequantize(ckpt), expected)


def test_gptq_8bit_reference_and_by_hand() -> None:
    from pagoda_quant_gptq_awq.formats import unpack_rows

    assert unpack_rows(torch.tensor([[0x7F80FF01]], dtype=torch.int32), 8).flatten().tolist() == [1, 255, 128, 127]
    ckpt, expected = _checkpoint("gptq", 24, 64, 16, act_order=True, bits=8)
    assert tuple(ckpt.qweight.shape) == (16, 24) and tuple(ckpt.qzeros.shape) == (4, 6)
    assert torch.equal(dequantize(ckpt), expected)


def test_gptq_v1_zeros_are_stored_minus_one() -> None:
    ckpt, expected = _checkpoint("gptq", 16, 32, 32)
    _, zeros, _ = unpack(ckpt)
    ckpt.zero_offset = 0  # read as v2 (zeros as stored): every weight moves by one scale step
    shifted = dequantize(ckpt)
    _, zeros_v2, scales = unpack(ckpt)
    assert torch.equal(zeros, zeros_v2 + 1)
    torch.testing.assert_close(shifted - expected, scales[0].expand(32, 16).t().contiguous())


def test_validate_names_the_bad_tensor() -> None:
    ckpt, _ = _checkpoint("awq", 16, 32, 16)
    ckpt.scales = ckpt.scales[:1]
    with pytest.raises(ValueError, match=r"scales: shape \(1, 16\)"):
        ckpt.validate("layer")


# -- the C++ kernel --------------------------------------------------------------------------------

@pytest.fixture
def kernel_path(request: pytest.FixtureRequest) -> Any:
    path = request.param
    if path not in cpu_kernel.paths():
        pytest.skip(f"this CPU does not run the {path} path")
    previous = os.environ.get(cpu_kernel.KERNEL_ENV)
    os.environ[cpu_kernel.KERNEL_ENV] = path
    yield path
    if previous is None:
        del os.environ[cpu_kernel.KERNEL_ENV]
    else:
        os.environ[cpu_kernel.KERNEL_ENV] = previous


def _cpu_weight(ckpt: PackedCheckpoint) -> cpu_kernel.CpuInt4Weight:
    lib = cpu_kernel.library()
    assert lib is not None, cpu_kernel.describe()
    q, zeros, scales = unpack(ckpt)
    return cpu_kernel.CpuInt4Weight.prepare(q, zeros, scales, group_index(ckpt), lib)


# (m, n, k, group): n not a multiple of 16 (a partial panel), one group, groups of 8, many rows (the slab path)
SHAPES = [(1, 64, 64, 32), (3, 40, 96, 32), (4, 24, 72, -1), (5, 8, 64, 8), (9, 48, 128, 32), (33, 72, 256, 64),
          (70, 40, 64, 16)]


@pytest.mark.parametrize("kernel_path", ["avx512", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("fmt,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_cpu_kernel_paths_equal_the_reference(kernel_path: str, fmt: str, act_order: bool, m: int, n: int, k: int,
                                              group: int) -> None:
    ckpt, weight = _checkpoint(fmt, n, k, group, act_order, seed=m + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    lib = cpu_kernel.library()
    assert lib is not None
    got = _cpu_weight(ckpt).matmul(x, bias, lib)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel_path", ["avx512", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("m", [1, 7, 8, 13])
def test_groups_of_uneven_length(kernel_path: str, m: int) -> None:
    """A g_idx that gives groups 5, 27 and 32 channels in scattered order (odd runs for the 2-k loop)."""
    gen = torch.Generator().manual_seed(m)
    k, n = 64, 32
    groups = torch.tensor([0] * 5 + [1] * 27 + [2] * 32)[torch.randperm(k, generator=gen)]
    q = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (3, n), generator=gen).float()
    scales = torch.rand(3, n, generator=gen)
    weight = ((q.float() - zeros[groups]) * scales[groups]).t()
    lib = cpu_kernel.library()
    assert lib is not None
    cw = cpu_kernel.CpuInt4Weight.prepare(q, zeros, scales, groups, lib)
    x = torch.randn(m, k, generator=gen)
    torch.testing.assert_close(cw.matmul(x, None, lib), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert cw.perm is not None
    torch.testing.assert_close(cw.slab_matmul(x.index_select(1, cw.perm).contiguous(), None, lib, 1),
                               F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel_path", ["avx512", "avx2"], indirect=True)
def test_slabs_narrower_than_the_layer(kernel_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # slabs of 16 columns x 64 inputs: several slabs, the last one partial (n = 40)
    monkeypatch.setattr(cpu_kernel, "SLAB_FLOATS", 16 * 64)
    ckpt, weight = _checkpoint("gptq", 40, 64, 16, act_order=True)
    x = torch.randn(20, 64)
    lib = cpu_kernel.library()
    assert lib is not None
    cw = _cpu_weight(ckpt)
    assert cw.perm is not None
    bias = torch.randn(40)
    torch.testing.assert_close(cw.slab_matmul(x.index_select(1, cw.perm).contiguous(), bias, lib, 2),
                               F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cw.dequantized(lib), weight)


def test_cpu_kernel_takes_half_precision_activations() -> None:
    ckpt, weight = _checkpoint("awq", 32, 64, 32)
    x = torch.randn(2, 64).bfloat16()
    lib = cpu_kernel.library()
    assert lib is not None
    torch.testing.assert_close(_cpu_weight(ckpt).matmul(x, None, lib), F.linear(x.float(), weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("flags,path", [(["-mno-avx512f"], 2), (["-mno-avx512f", "-mno-avx2", "-mno-fma"], 3)],
                         ids=["avx2", "portable"])
def test_builds_without_avx512_match_the_reference(tmp_path: Path, flags: list[str], path: int) -> None:
    """The AVX2 and portable paths built as a CPU without AVX-512 (or AVX2) builds them, called through ctypes."""
    library = ctypes.CDLL(str(cpu_kernel.EXTENSION.compile_to(tmp_path / "libint4.so", flags)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.pagoda_int4_pack.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    library.pagoda_int4_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, ptr,
                                         ctypes.c_int]
    library.pagoda_int4_dequantize.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr,
                                               ctypes.c_int]
    for m, n, k, group in SHAPES[:5]:
        ckpt, weight = _checkpoint("awq", n, k, group, seed=n * k)
        q, zeros, scales = unpack(ckpt)
        g = int(scales.shape[0])
        panels = -(-n // 16)
        packed = torch.empty(panels * k * 8, dtype=torch.uint8)
        ps, pz = torch.empty(panels * g * 16), torch.empty(panels * g * 16)
        q, zeros, scales = q.contiguous(), zeros.contiguous(), scales.contiguous()
        library.pagoda_int4_pack(q.data_ptr(), scales.data_ptr(), zeros.data_ptr(), k, n, g, packed.data_ptr(),
                                 ps.data_ptr(), pz.data_ptr())
        gstart = torch.tensor([min(k, i * ckpt.group_size) for i in range(g + 1)], dtype=torch.int64)
        x = torch.randn(m, k)
        y = torch.empty(m, n)
        assert library.pagoda_int4_gemm(path, x.data_ptr(), m, k, packed.data_ptr(), ps.data_ptr(), pz.data_ptr(),
                                        gstart.data_ptr(), g, None, n, k, y.data_ptr(), 2) == path
        torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-4)
        slab = torch.empty(k, n)
        assert library.pagoda_int4_dequantize(path, packed.data_ptr(), ps.data_ptr(), pz.data_ptr(), gstart.data_ptr(),
                                              g, n, k, 0, n, slab.data_ptr(), 2) == path
        torch.testing.assert_close(slab.t(), weight)


def test_a_path_this_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = cpu_kernel.library()
    assert lib is not None
    # the library answers -1 for a path code it does not know: the wrapper names the paths that run
    monkeypatch.setattr(cpu_kernel, "path_code", lambda: 7)
    ckpt, _ = _checkpoint("awq", 16, 32, 32)
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        _cpu_weight(ckpt).matmul(torch.randn(1, 32), None, lib)


# -- the Triton kernel (interpreted without a GPU) -------------------------------------------------

TRITON_SHAPES = [(1, 64, 64, 32), (5, 40, 96, 32), (17, 72, 128, -1)]


@pytest.mark.parametrize("fmt,act_order,bits", [("gptq", False, 4), ("gptq", True, 4), ("awq", False, 4),
                                                ("gptq", True, 8)])
@pytest.mark.parametrize("m,n,k,group", TRITON_SHAPES)
def test_triton_kernel_equals_the_reference(fmt: str, act_order: bool, bits: int, m: int, n: int, k: int,
                                            group: int) -> None:
    pytest.importorskip("triton")
    from pagoda_quant_gptq_awq import triton_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt, weight = _checkpoint(fmt, n, k, group, act_order, seed=m * n + k, bits=bits)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        if getattr(ckpt, name) is not None:
            setattr(ckpt, name, getattr(ckpt, name).to(device))
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = triton_kernel.matmul(x.to(device), ckpt, bias.to(device)).cpu()
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_triton_kernel_half_precision_activations() -> None:
    pytest.importorskip("triton")
    from pagoda_quant_gptq_awq import triton_kernel

    ckpt, weight = _checkpoint("awq", 32, 64, 32)
    x = torch.randn(3, 64)
    got = triton_kernel.matmul(x.bfloat16(), ckpt, None)
    # the dot's operands are float32 (TF32 on a GPU): only the activations' own rounding to bf16 remains
    torch.testing.assert_close(got, F.linear(x.bfloat16().float(), weight), rtol=1e-3, atol=1e-3)
