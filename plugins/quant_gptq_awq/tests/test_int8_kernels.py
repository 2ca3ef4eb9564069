"""The 8-bit GPTQ C++ kernel against the torch reference (``formats.dequantize``): every path this CPU runs,
symmetric and asymmetric zeros, act order, odd shapes, and a build without AVX-512."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from int4_checkpoints import gptq_tensors, quantize

from pagoda_quant_gptq_awq import cpu_int8_kernel
from pagoda_quant_gptq_awq.formats import PackedCheckpoint, dequantize, group_index, unpack

FLOAT_PATHS = ["avx512", "avx2", "scalar"]


def _checkpoint(n: int, k: int, group_size: int, act_order: bool = False, sym: bool = False,
                seed: int = 0) -> tuple[PackedCheckpoint, torch.Tensor]:
    """A random [n, k] weight quantized to 8 bits and packed as AutoGPTQ writes it, with the float weight it stores."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // (k if group_size == -1 else group_size)
    qz = quantize(weight, group_size, g_idx, sym=sym, min_zero=1, bits=8)
    tensors = gptq_tensors(qz, 8)
    ckpt = PackedCheckpoint("gptq", tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                            k if group_size == -1 else group_size, 1, k, n, 8)
    ckpt.validate("test")
    assert torch.equal(dequantize(ckpt), qz.dequantized)
    return ckpt, qz.dequantized


def _library() -> Any:
    lib = cpu_int8_kernel.library()
    assert lib is not None, cpu_int8_kernel.describe()
    return lib


def _cpu_weight(ckpt: PackedCheckpoint) -> cpu_int8_kernel.CpuInt8Weight:
    q, zeros, scales = unpack(ckpt)
    return cpu_int8_kernel.CpuInt8Weight.prepare(q, zeros, scales, group_index(ckpt), _library())


@pytest.fixture
def kernel_path(request: pytest.FixtureRequest) -> Any:
    path = request.param
    if path not in cpu_int8_kernel.paths():
        pytest.skip(f"this CPU does not run the {path} path")
    previous = os.environ.get(cpu_int8_kernel.KERNEL_ENV)
    os.environ[cpu_int8_kernel.KERNEL_ENV] = path
    yield path
    if previous is None:
        del os.environ[cpu_int8_kernel.KERNEL_ENV]
    else:
        os.environ[cpu_int8_kernel.KERNEL_ENV] = previous


# the VNNI paths: the largest activation code of each, their activations being integers of that many bits
VNNI_PATHS = {"vnni512": 127, "vnni512_int16": 32767}


def _int_activations(x: torch.Tensor, groups: torch.Tensor, qmax: int) -> torch.Tensor:
    """What a VNNI path multiplies: each row's activations, in blocks of 32 channels restarting at every group
    (in group order), quantized with the block's absolute maximum as ``qmax``, dequantized back."""
    order = torch.argsort(groups, stable=True)
    xs = x.index_select(1, order)
    sorted_groups = groups[order]
    out = torch.empty_like(xs)
    for g in sorted_groups.unique().tolist():
        cols = (sorted_groups == g).nonzero().flatten()
        for i in range(0, cols.numel(), 32):
            block = xs[:, cols[i:i + 32]]
            amax = block.abs().amax(dim=1, keepdim=True)
            scale = amax / qmax
            inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
            out[:, cols[i:i + 32]] = torch.round(block * inv) * scale
    result = torch.empty_like(x)
    result[:, order] = out
    return result


def _check_auto(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor) -> None:
    """``got`` against the reference for the path ``auto`` runs (a VNNI path: on its integer activations)."""
    path = cpu_int8_kernel.paths()[0]
    if path in VNNI_PATHS:
        torch.testing.assert_close(got, F.linear(_int_activations(x, groups, VNNI_PATHS[path]), weight), rtol=1e-5,
                                   atol=5e-4)
    else:
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


# (m, n, k, group): n not a multiple of 16 (a partial panel), k not a multiple of 32 (a short last group),
# one group, groups of 8 (each a 4-k block pair), rows past a tile
SHAPES = [(1, 64, 64, 32), (3, 20, 100, 32), (4, 36, 72, -1), (5, 8, 64, 8), (9, 44, 128, 32), (33, 72, 256, 64),
          (70, 40, 64, 16)]


@pytest.mark.parametrize("kernel_path", FLOAT_PATHS, indirect=True)
@pytest.mark.parametrize("act_order,sym", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_float_paths_equal_the_reference(kernel_path: str, act_order: bool, sym: bool, m: int, n: int, k: int,
                                         group: int) -> None:
    ckpt, weight = _checkpoint(n, k, group, act_order, sym, seed=m + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = _cpu_weight(ckpt).matmul(x, bias, _library())
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel_path", list(VNNI_PATHS), indirect=True)
@pytest.mark.parametrize("act_order,sym", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_vnni_paths_equal_the_reference_on_their_integer_activations(kernel_path: str, act_order: bool, sym: bool,
                                                                     m: int, n: int, k: int, group: int) -> None:
    ckpt, weight = _checkpoint(n, k, group, act_order, sym, seed=m + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = _cpu_weight(ckpt).matmul(x, bias, _library())
    # exact but for float summation order against its own activations; a percent or so off the float ones
    # int16: an activation may round one code apart from torch's (an output then moves by ~1e-4)
    torch.testing.assert_close(got, F.linear(_int_activations(x, group_index(ckpt), VNNI_PATHS[kernel_path]), weight,
                                             bias), rtol=1e-5, atol=1e-4 if kernel_path == "vnni512" else 5e-4)
    reference = F.linear(x, weight, bias)
    # measured: int8 about 5e-3 off the float activations' result, int16 about 2e-5
    assert (got - reference).norm() / reference.norm() < (2e-2 if kernel_path == "vnni512" else 1e-4)


@pytest.mark.parametrize("kernel_path", [*FLOAT_PATHS, *VNNI_PATHS], indirect=True)
@pytest.mark.parametrize("m", [1, 7, 8, 13])
def test_groups_of_uneven_length_and_extreme_zeros(kernel_path: str, m: int) -> None:
    """A g_idx that gives groups 5, 27 and 32 channels in scattered order (padded blocks), with zeros 0 and 256
    (GPTQ v1's range) and bytes 0 and 255."""
    gen = torch.Generator().manual_seed(m)
    k, n = 64, 32
    groups = torch.tensor([0] * 5 + [1] * 27 + [2] * 32)[torch.randperm(k, generator=gen)]
    q = torch.randint(0, 256, (k, n), dtype=torch.uint8, generator=gen)
    q[0, :4] = torch.tensor([0, 255, 0, 255], dtype=torch.uint8)
    zeros = torch.randint(0, 257, (3, n), generator=gen).float()
    zeros[:, 0], zeros[:, 1] = 256, 0
    scales = torch.rand(3, n, generator=gen) * 0.01
    weight = ((q.float() - zeros[groups]) * scales[groups]).t()
    lib = _library()
    cw = cpu_int8_kernel.CpuInt8Weight.prepare(q, zeros, scales, groups, lib)
    assert cw.perm is not None and cw.gpad.tolist() == [0, 8, 36, 68]
    x = torch.randn(m, k, generator=gen)
    xq = _int_activations(x, groups, VNNI_PATHS[kernel_path]) if kernel_path in VNNI_PATHS else x
    torch.testing.assert_close(cw.matmul(x, None, lib), F.linear(xq, weight), rtol=1e-5,
                               atol=5e-4 if kernel_path == "vnni512_int16" else 1e-4)
    torch.testing.assert_close(cw.slab_matmul(x.index_select(1, cw.perm).contiguous(), None, lib, 1),
                               F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cw.dequantized(lib), weight)


@pytest.mark.parametrize("kernel_path", ["avx512", "avx2"], indirect=True)
def test_slabs_narrower_than_the_layer(kernel_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # slabs of 16 columns x 64 inputs: several slabs, the last one partial (n = 40)
    monkeypatch.setattr(cpu_int8_kernel, "SLAB_FLOATS", 16 * 64)
    ckpt, weight = _checkpoint(40, 64, 16, act_order=True)
    x = torch.randn(20, 64)
    lib = _library()
    cw = _cpu_weight(ckpt)
    assert cw.perm is not None
    bias = torch.randn(40)
    torch.testing.assert_close(cw.slab_matmul(x.index_select(1, cw.perm).contiguous(), bias, lib, 2),
                               F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cw.dequantized(lib), weight)


@pytest.mark.parametrize("kernel_path", ["avx2", "scalar"], indirect=True)
def test_rows_past_the_tiles_take_the_slabs(kernel_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, weight = _checkpoint(24, 64, 32)
    cw = _cpu_weight(ckpt)
    widened: list[int] = []
    monkeypatch.setattr(cw, "_widen", lambda n0, n1, lib, threads, f=cw._widen: widened.append(n1) or f(n0, n1, lib, threads))
    x = torch.randn(cpu_int8_kernel.IN_REGISTER_MAX_ROWS[kernel_path] + 1, 64)  # type: ignore[operator]
    torch.testing.assert_close(cw.matmul(x, None, _library()), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert widened == [24]


def test_half_precision_activations() -> None:
    ckpt, weight = _checkpoint(32, 64, 32)
    x = torch.randn(2, 64).bfloat16()
    _check_auto(_cpu_weight(ckpt).matmul(x, None, _library()), x.float(), weight, group_index(ckpt))


def test_forward_reads_no_tensor_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel graphs replay the calls a capture records: the wrapper must decide nothing from tensor values."""
    ckpt, weight = _checkpoint(40, 64, 16, act_order=True)
    cw = _cpu_weight(ckpt)
    x = torch.randn(3, 64)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the forward path read a tensor's values")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = cw.matmul(x, None, _library())
    monkeypatch.undo()
    _check_auto(got, x, weight, group_index(ckpt))


@pytest.mark.parametrize("kernel_path", [*FLOAT_PATHS, *VNNI_PATHS], indirect=True)
def test_forward_replays_as_a_kernel_graph(kernel_path: str) -> None:
    """A captured forward (act order: a permutation, then the kernel; the portable path: the slabs and torch's
    matmul) replayed on new activations gives what an eager call gives."""
    from pagoda.cpp_extension import graph

    ckpt, _ = _checkpoint(40, 64, 16, act_order=True)
    cw = _cpu_weight(ckpt)
    lib = _library()
    x = torch.randn(3, 64)
    captured, out = graph.capture(lambda: cw.matmul(x, None, lib), roots=[cw, x])
    x.copy_(torch.randn(3, 64))
    captured.replay()
    torch.testing.assert_close(out, cw.matmul(x, None, lib), rtol=0, atol=0)


def test_fractional_zeros_are_refused() -> None:
    with pytest.raises(ValueError, match="zero points must be integers"):
        cpu_int8_kernel.CpuInt8Weight.prepare(torch.zeros(8, 4, dtype=torch.uint8), torch.full((1, 4), 1.5),
                                              torch.ones(1, 4), torch.zeros(8, dtype=torch.int64), _library())


def test_a_path_this_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_int8_kernel, "path_code", lambda: 9)  # a code the library does not know
    ckpt, _ = _checkpoint(16, 32, 32)
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        _cpu_weight(ckpt).matmul(torch.randn(1, 32), None, _library())


@pytest.mark.parametrize("flags,path", [(["-mno-avx512f"], 2), (["-mno-avx512f", "-mno-avx2", "-mno-fma"], 3)],
                         ids=["avx2", "portable"])
def test_builds_without_avx512_match_the_reference(tmp_path: Path, flags: list[str], path: int) -> None:
    """The AVX2 and portable paths built as a CPU without AVX-512 (or AVX2) builds them, called through ctypes."""
    library = ctypes.CDLL(str(cpu_int8_kernel.EXTENSION.compile_to(tmp_path / "libgptq8.so", flags)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.pagoda_gptq8_pack.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    library.pagoda_gptq8_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64,
                                          ptr, ctypes.c_int]
    library.pagoda_gptq8_dequantize.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr,
                                                ctypes.c_int]
    for m, n, k, group in SHAPES[:5]:
        ckpt, weight = _checkpoint(n, k, group, sym=m % 2 == 0, seed=n * k)
        q, zeros, scales = unpack(ckpt)
        g = int(scales.shape[0])
        q, scales, zeros = q.contiguous(), scales.contiguous(), zeros.to(torch.int32).contiguous()
        gstart = torch.tensor([min(k, i * ckpt.group_size) for i in range(g + 1)], dtype=torch.int64)
        gpad = torch.zeros(g + 1, dtype=torch.int64)
        gpad[1:] = torch.cumsum((gstart.diff() + 3) // 4 * 4, 0)
        panels, kp = -(-n // 16), int(gpad[-1])
        packed = torch.empty(panels * kp * 16, dtype=torch.uint8)
        ps, pz = torch.empty(panels * g * 16), torch.empty(panels * g * 16, dtype=torch.int32)
        library.pagoda_gptq8_pack(q.data_ptr(), scales.data_ptr(), zeros.data_ptr(), gstart.data_ptr(),
                                  gpad.data_ptr(), k, n, g, packed.data_ptr(), ps.data_ptr(), pz.data_ptr())
        x = torch.randn(m, k)
        y = torch.empty(m, n)
        assert library.pagoda_gptq8_gemm(path, x.data_ptr(), m, k, packed.data_ptr(), ps.data_ptr(), pz.data_ptr(),
                                         gstart.data_ptr(), gpad.data_ptr(), g, None, n, k, y.data_ptr(), 2) == path
        torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-4)
        slab = torch.empty(k, n)
        assert library.pagoda_gptq8_dequantize(path, packed.data_ptr(), ps.data_ptr(), pz.data_ptr(),
                                               gstart.data_ptr(), gpad.data_ptr(), g, n, k, 0, n, slab.data_ptr(),
                                               2) == path
        torch.testing.assert_close(slab.t(), weight)
