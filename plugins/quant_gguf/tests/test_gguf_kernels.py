"""The torch dequantizers against the gguf package's, and the C++ kernel (this CPU's path, the AVX2
path built without AVX-512, and the portable one) against the torch reference; the K-quant kernels
also against their own integer arithmetic (x quantized per 256 values, exactly as the kernel does)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagoda_quant_gguf import kernels
from pagoda_quant_gguf.dequant import dequantize_blocks

BASIC = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# where each K-quant block keeps its f16 super-block scale(s) (ggml-common.h)
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_blocks(qtype: Q, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random K-quant blocks with small finite f16 scales (gguf 0.19 has no K-quant quantizer)."""
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(rows, blocks_per_row, nbytes), dtype=np.uint8)
    for i, offset in enumerate(K_QUANT_SCALES[qtype]):
        # distinct per block and per field (d apart from dmin), so a misplaced scale shows
        scales = rng.uniform(0.005, 0.02, size=blocks.shape[:2]).astype(np.float16) * (1 + i)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, blocks_per_row * nbytes)


@pytest.mark.parametrize("qtype", BASIC, ids=lambda q: q.name)
def test_torch_dequant_equals_gguf(qtype: Q) -> None:
    weight = np.random.default_rng(0).standard_normal((7, 256)).astype(np.float32)
    blocks = quantize(weight, qtype)
    ours = dequantize_blocks(torch.from_numpy(blocks), int(qtype), 256)
    np.testing.assert_array_equal(ours.numpy(), dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda q: q.name)
def test_k_quant_dequant_equals_gguf(qtype: Q) -> None:
    blocks = random_k_blocks(qtype, 3, 2)
    ours = dequantize_blocks(torch.from_numpy(blocks), int(qtype), 512)
    np.testing.assert_array_equal(ours.numpy(), dequantize(blocks, qtype))


def _case(qtype: Q, m: int, n: int = 45, k: int = 320) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(m)
    if qtype in K_QUANT_SCALES:
        blocks = torch.from_numpy(random_k_blocks(qtype, n, k // 256))
    else:
        blocks = torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), qtype))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    reference = x @ dequantize_blocks(blocks, int(qtype), k).T
    return blocks, x, reference


def _close(y: torch.Tensor, reference: torch.Tensor) -> None:
    # x is quantized to int8 per 32 values (per 256 for the K-quants), as llama.cpp does: ~0.5% of the
    # output's range, measured
    err = float((y - reference).abs().max() / reference.abs().max())
    assert err < 0.02, err


def _k_exact_reference(blocks: torch.Tensor, qtype: Q, x: torch.Tensor) -> torch.Tensor:
    """x quantized per 256 values to int8 as the kernel does, times the dequantized weights, in float64:
    what the kernel's integer arithmetic computes, up to float32 rounding of its per-super-block sums."""
    k = x.shape[1]
    xb = x.reshape(-1, 256)
    amax = xb.abs().amax(dim=1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    xq = (q * (amax / 127.0)).reshape(x.shape)
    return (xq.double() @ dequantize_blocks(blocks, int(qtype), k).double().T).float()


KERNEL_TYPES = BASIC + list(K_QUANT_SCALES)
# K-quant shapes: whole super-blocks; the row counts leave a remainder after the 4-row decode tiles
K_SHAPES = [(45, 256), (7, 768), (130, 512)]


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_kernel_matches_reference(qtype: Q, m: int) -> None:
    blocks, x, reference = _case(qtype, m, k=512 if qtype in K_QUANT_SCALES else 320)
    assert kernels.supports(int(qtype), x), kernels.describe()
    _close(kernels.matmul(x, blocks, int(qtype), x.shape[1]), reference)


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("shape", K_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_k_quant_kernel_equals_its_integer_arithmetic(qtype: Q, m: int, shape: tuple[int, int]) -> None:
    blocks, x, _ = _case(qtype, m, *shape)
    y = kernels.matmul(x, blocks, int(qtype), x.shape[1])
    expected = _k_exact_reference(blocks, qtype, x)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


PACKED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("n", [45, 7, 64])  # a tail of 1 and 3 rows past the 4-row groups, none
def test_repacked_kernel_equals_the_stored_layout_kernel(qtype: Q, m: int, n: int) -> None:
    blocks, x, reference = _case(qtype, m, n=n)
    packed = kernels.repack(blocks, int(qtype), x.shape[1])
    assert packed is not None and packed.shape == blocks.shape
    assert not torch.equal(packed, blocks)
    y = kernels.matmul(x, packed, int(qtype), x.shape[1], packed=True)
    # bit for bit: the same float operations in the same order, only the bytes' places differ
    assert torch.equal(y, kernels.matmul(x, blocks, int(qtype), x.shape[1]))
    _close(y, reference)
    ids = torch.tensor([n - 1, 0, 5 % n, n - 1, n // 2])
    assert torch.equal(kernels.unpack_rows(packed, int(qtype), x.shape[1], ids), blocks[ids])
    with pytest.raises(IndexError):
        kernels.unpack_rows(packed, int(qtype), x.shape[1], torch.tensor([n]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_types_without_a_repacked_layout_stay_as_stored(qtype: Q) -> None:
    blocks, x, _ = _case(qtype, 1, k=512)
    assert kernels.repack(blocks, int(qtype), x.shape[1]) is None


@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"]],
                         ids=["avx2", "portable"])
def test_other_isa_builds_match_reference(tmp_path: Path, flags: list[str]) -> None:
    library = ctypes.CDLL(str(kernels.EXTENSION.compile_to(tmp_path / "libgguf.so", flags)))
    library.pagoda_gguf_isa.restype = ctypes.c_char_p
    expected = "avx2" if "-mno-avx2" not in flags else "scalar"
    assert library.pagoda_gguf_isa().decode() == expected
    fn = library.pagoda_gguf_linear
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    library.pagoda_gguf_repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.pagoda_gguf_unpack_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    for qtype in KERNEL_TYPES:
        for m in (1, 5):
            blocks, x, reference = _case(qtype, m, k=512 if qtype in K_QUANT_SCALES else 320)
            n, k = blocks.shape[0], x.shape[1]
            y = torch.empty(m, n)
            assert fn(int(qtype), 0, blocks.data_ptr(), n, k, x.data_ptr(), 0, m, y.data_ptr(), 0, 2) == 0
            _close(y, reference)
            # 16-bit activations in and out: the float32 result of the same (exactly widened) x, rounded
            for dtype, code in ((torch.bfloat16, 1), (torch.float16, 2)):
                x16 = x.to(dtype)
                x16_widened, y32, y16 = x16.float(), torch.empty(m, n), torch.empty(m, n, dtype=dtype)
                assert fn(int(qtype), 0, blocks.data_ptr(), n, k, x16_widened.data_ptr(), 0, m, y32.data_ptr(), 0, 2) == 0
                assert fn(int(qtype), 0, blocks.data_ptr(), n, k, x16.data_ptr(), code, m, y16.data_ptr(), code, 2) == 0
                assert torch.equal(y16, y32.to(dtype))
            packed = torch.empty_like(blocks)
            repacked = library.pagoda_gguf_repack(int(qtype), blocks.data_ptr(), n, k, packed.data_ptr()) == 0
            # the repacked kernel is built on AVX2 (and its AVX-512 VNNI form); the portable build has none
            assert repacked == (qtype in PACKED and expected == "avx2") == bool(library.pagoda_gguf_repacks(int(qtype)))
            if repacked:
                y_packed = torch.empty(m, n)
                assert fn(int(qtype), 1, packed.data_ptr(), n, k, x.data_ptr(), 0, m, y_packed.data_ptr(), 0, 2) == 0
                assert torch.equal(y_packed, y)
                ids = torch.tensor([n - 1, 0, n // 2])
                rows = torch.empty((3, blocks.shape[1]), dtype=torch.uint8)
                assert library.pagoda_gguf_unpack_rows(int(qtype), packed.data_ptr(), n, k, ids.data_ptr(), 3,
                                                       rows.data_ptr()) == 0
                assert torch.equal(rows, blocks[ids])
            else:
                assert fn(int(qtype), 1, blocks.data_ptr(), n, k, x.data_ptr(), 0, m, y.data_ptr(), 0, 2) == -1
            if qtype in K_QUANT_SCALES:
                exact = _k_exact_reference(blocks, qtype, x)
                torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))


def test_kernel_refuses_what_it_cannot_run() -> None:
    assert not kernels.supports(int(Q.Q4_0), torch.randn(1, 48))  # not whole blocks
    assert not kernels.supports(int(Q.Q4_K), torch.randn(1, 288))  # not whole super-blocks
    assert not kernels.supports(int(Q.IQ4_NL), torch.randn(1, 256))  # a type without a kernel
    assert not kernels.supports(int(Q.Q4_K), torch.randn(1, 256, device="meta"))  # not a CPU tensor


def test_layers_repack_on_cpu_unless_triton_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from pagoda_quant_gguf import config

    blocks, x, reference = _case(Q.Q4_1, 2, n=8)

    def assemble() -> config.Shard:
        layer = nn.Module()
        config._register(layer)
        layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(Q.Q4_1)), None)
        layer.qweight.weight_loader(layer.qweight, blocks, None)
        [shard] = config._assemble(layer, x.shape[1], blocks.shape[0])
        assert layer.qweight.data_ptr() == shard.blocks.data_ptr()  # the memory report counts the kept bytes
        return shard

    shard = assemble()
    assert shard.packed
    assert torch.equal(config.matmul([shard], x, x.shape[1]), kernels.matmul(x, blocks, int(Q.Q4_1), x.shape[1]))
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    assert not assemble().packed


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_forward_is_the_kernel_bound_at_load(qtype: Q, dtype: torch.dtype) -> None:
    """The layer's call is the kernel bound at load (packed where the type repacks), in the model's dtype:
    the float32 kernel result of the same activations, rounded once; leading dims, strided input and bias kept."""
    from pagoda.layers import Linear
    from pagoda_quant_gguf import config

    blocks, _, _ = _case(qtype, 1, n=12, k=64)
    layer = Linear(64, 12, bias=True, dtype=dtype)
    method = config.GGUFLinearMethod()
    method.create_weights(layer, 64, [12], 64, 12, dtype)
    layer.quant_method = method
    layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(qtype)), None)
    layer.qweight.weight_loader(layer.qweight, blocks, None)
    method.process_weights_after_loading(layer)
    assert isinstance(method.forward, config.KernelForward)
    assert method.shards[0].packed == (qtype in PACKED)
    bias = torch.randn(12).to(dtype)
    x = torch.randn(2, 3, 64).to(dtype)
    expected = kernels.matmul(x.reshape(-1, 64).float(), blocks, int(qtype), 64).to(dtype).reshape(2, 3, 12)
    assert torch.equal(layer.quant_method.apply(layer, x), expected)
    assert torch.equal(layer.quant_method.apply(layer, x, bias), expected + bias)
    strided = torch.randn(3, 128).to(dtype)[:, ::2]
    assert torch.equal(method.apply(layer, strided), kernels.matmul(strided.float(), blocks, int(qtype), 64).to(dtype))
    with pytest.raises(ValueError):
        method.apply(layer, torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(ValueError):
        method.apply(layer, torch.randn(3, 32).to(dtype))


def test_layer_and_lookup_replay_in_a_kernel_graph() -> None:
    """A bound layer's call and a repacked table's lookup are captured by a CPU kernel graph (no value
    reads, every pointer in memory the layer holds) and replay to what an eager call gives on new inputs."""
    from pagoda.cpp_extension import graph
    from pagoda.layers import Embedding, Linear
    from pagoda_quant_gguf import config

    blocks, _, _ = _case(Q.Q4_1, 1, n=12, k=64)
    layer = Linear(64, 12, bias=False, dtype=torch.bfloat16)
    method = config.GGUFLinearMethod()
    method.create_weights(layer, 64, [12], 64, 12, torch.bfloat16)
    layer.quant_method = method
    table = Embedding(12, 64, dtype=torch.bfloat16)
    lookup = config.GGUFEmbeddingMethod()
    lookup.create_weights(table, 12, 64, torch.bfloat16)
    table.quant_method = lookup
    for module in (layer, table):
        module.qweight_type.weight_loader(module.qweight_type, torch.tensor(int(Q.Q4_1)), None)
        module.qweight.weight_loader(module.qweight, blocks, None)
        module.quant_method.process_weights_after_loading(module)
    assert method.shards[0].packed and lookup.shards[0].packed
    ids = torch.tensor([3, 0, 11])
    x = torch.randn(2, 64).to(torch.bfloat16)

    def forward() -> torch.Tensor:
        return layer(x) + lookup.embedding(table, ids)[:2, :12]

    captured, output = graph.capture(forward, roots=[layer, table, x, ids])
    assert captured.num_kernel_calls == 2  # the layer's pagoda_gguf_linear, the table's unpack_rows
    first = output.clone()
    x.copy_(torch.randn(2, 64).to(torch.bfloat16))
    ids.copy_(torch.tensor([7, 5, 1]))
    expected = forward()  # eager, on the new inputs
    assert not torch.equal(expected, first)
    captured.replay()  # rewrites the captured output in place
    assert torch.equal(output, expected)
