"""The Triton int8 kernels (W8A8 with dynamic per-token activations, W8A16) against the torch
references in ``kernels``, run under ``TRITON_INTERPRET=1`` where there is no GPU (conftest)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagoda_quant_compressed_tensors import kernels, triton_path

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)

from pagoda_quant_compressed_tensors import triton_kernels  # noqa: E402  (after TRITON_INTERPRET is settled)

# decode, a ragged prefill, odd N and K (masked tiles), K over one 64-wide tile loop and the 1024 row block
SHAPES = [(1, 64, 64), (5, 17, 9), (19, 70, 100), (3, 33, 1100)]


def _weights(n: int, k: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # -128 included, as checkpoints may hold it
    return w, torch.rand(n, groups, generator=gen) * 0.01 + 1e-4


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, : min(k, 3)] = 0.0
    return x


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_per_token_quantization_equals_the_reference(m: int, n: int, k: int) -> None:
    x = _x(m, k, seed=m + k)
    x[-1] = 0.0  # an all-zero row: scale 0, q 0 (no division by zero)
    q, scale = triton_kernels.quantize_per_token(x.to(DEVICE))
    q_ref, scale_ref = kernels.quantize_per_token(x)
    torch.testing.assert_close(scale.cpu(), scale_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.cpu(), q_ref, rtol=0, atol=0)


def test_quantization_rounds_half_to_even() -> None:
    # max 127 gives scale 1.0 exactly: x / scale are the halves themselves
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]])
    q, scale = triton_kernels.quantize_per_token(x.to(DEVICE))
    assert float(scale) == 1.0
    assert q.cpu().tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_w8a8_equals_the_reference(m: int, n: int, k: int, with_bias: bool) -> None:
    w, scale = _weights(n, k, 1, seed=m * n + k)
    x = _x(m, k, seed=n)
    bias = torch.randn(n) if with_bias else None
    expected = kernels.W8A8Weight.prepare(w, scale.reshape(-1), on_cpu=False).matmul(x, bias)
    got = triton_kernels.w8a8_matmul(x.to(DEVICE), w.to(DEVICE), scale.reshape(-1).to(DEVICE),
                                     None if bias is None else bias.to(DEVICE))
    # int32 sums are exact on both sides; only the float rescale's rounding order differs
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [None, 32, 48])  # per channel; groups a tile holds two of; groups across tiles
def test_w8a16_equals_the_reference(m: int, n: int, k: int, group: int | None) -> None:
    group_size = group or k
    w, scale = _weights(n, k, -(-k // group_size), seed=m + n * k)
    x = _x(m, k, seed=k)
    bias = torch.randn(n)
    expected = kernels.W8A16Weight.prepare(w, scale, group_size, on_cpu=False).matmul(x, bias)
    got = triton_kernels.w8a16_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), group_size, bias.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_w8a16_16_bit_activations(dtype: torch.dtype) -> None:
    w, scale = _weights(40, 96, 3, seed=4)
    x = _x(3, 96, seed=5).to(dtype)
    reference = kernels.W8A16Weight.prepare(w, scale, 32, on_cpu=False).matmul(x.float(), None)
    got = triton_kernels.w8a16_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), 32, None).cpu()
    # fp16 rounds the scaled weight to fp16 for the dot (bf16 too on a GPU): a few 16-bit ulps of the sum
    err = float((got - reference).abs().max() / reference.abs().max())
    assert err < 1e-2


def test_bad_inputs_are_refused() -> None:
    w, scale = _weights(8, 32, 1, seed=1)
    with pytest.raises(ValueError, match="activations"):
        triton_kernels.w8a8_matmul(torch.zeros(2, 32, dtype=torch.float64, device=DEVICE), w.to(DEVICE),
                                   scale.reshape(-1).to(DEVICE), None)
    with pytest.raises(ValueError, match="for activations of 16 columns"):
        triton_kernels.w8a8_matmul(torch.zeros(2, 16, device=DEVICE), w.to(DEVICE), scale.reshape(-1).to(DEVICE), None)
    with pytest.raises(ValueError, match="groups of 16"):
        triton_kernels.w8a16_matmul(torch.zeros(2, 32, device=DEVICE), w.to(DEVICE), scale.to(DEVICE), 16, None)


def test_layer_weights_take_triton_when_asked_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight prepared off the C++ library (as on a GPU) runs Triton under PAGODA_KERNELS_IMPL=triton."""
    if DEVICE != "cpu":
        pytest.skip("checks the CPU dispatch")
    monkeypatch.delenv("PAGODA_KERNELS_IMPL", raising=False)  # the defaults, whatever this run set
    monkeypatch.delenv("PAGODA_INT8_KERNEL", raising=False)  # the defaults, whatever this run set
    w, scale = _weights(24, 64, 2, seed=9)
    x = _x(2, 64, seed=10)
    w8a8 = kernels.W8A8Weight.prepare(w, scale[:, 0].contiguous(), on_cpu=False)
    w8a16 = kernels.W8A16Weight.prepare(w, scale, 32, on_cpu=False)
    reference = w8a8.matmul(x, None), w8a16.matmul(x, None)
    calls: list[str] = []
    for name in ("w8a8_matmul", "w8a16_matmul"):  # counted, the real kernels still run
        real = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    assert not triton_path.supports(x)
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    assert triton_path.supports(x)
    torch.testing.assert_close(w8a8.matmul(x, None), reference[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w8a16.matmul(x, None), reference[1], rtol=1e-5, atol=1e-4)
    assert calls == ["w8a8_matmul", "w8a16_matmul"]
    monkeypatch.setenv("PAGODA_INT8_KERNEL", "0")
    assert not triton_path.supports(x)


@pytest.mark.parametrize("target", ["cuda-sm90", "rocm-gfx942"])
def test_kernels_compile_for_gpus(target: str) -> None:
    """The three kernels lowered by Triton's compiler for an H100 and an MI300 (no device needed): the int8
    tl.dot with an int32 accumulator, the rounding's add and subtract, both W8A16 dot branches."""
    from pagoda.testing.triton_compile import KernelCase, compile_for_target

    module = triton_kernels.__name__
    tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}
    dims = {"M": "i32", "N": "i32", "K": "i32"}
    cases = [
        KernelCase("quantize", module, "_quantize_rows_kernel",
                   {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32",
                    "stride_q": "i32", "BLOCK_K": "constexpr"}, {"BLOCK_K": 1024}),
        KernelCase("w8a8", module, "_w8a8_kernel",
                   {"q_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "b_ptr": "*fp32",
                    "y_ptr": "*fp32", **dims, "stride_q": "i32", "stride_w": "i32", "stride_y": "i32",
                    **dict.fromkeys(("HAS_BIAS", *tiles), "constexpr")}, {"HAS_BIAS": True, **tiles}),
    ]
    for x, ieee in (("*fp32", True), ("*fp16", False), ("*bf16", False)):
        cases.append(KernelCase(
            f"w8a16-{x[1:]}", module, "_w8a16_kernel",
            {"x_ptr": x, "w_ptr": "*i8", "ws_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp32", **dims,
             "groups": "i32", "group_size": "i32", "stride_x": "i32", "stride_w": "i32", "stride_y": "i32",
             **dict.fromkeys(("HAS_BIAS", "IEEE", *tiles), "constexpr")}, {"HAS_BIAS": False, "IEEE": ieee, **tiles}))
    results = compile_for_target(cases, target)
    assert results == {c.name: "ok" for c in cases}


@pytest.mark.parametrize("dynamic", [True, False], ids=["w8a8", "w8a16"])
def test_weights_go_to_the_models_device(dynamic: bool) -> None:
    """The loader reads the int8 weight into host memory; a layer built on another device (a GPU; here
    ``meta``, which holds no data) gets it there, unpacked for no CPU library (the Triton kernels read it)."""
    from pagoda.layers import Linear
    from pagoda_quant_compressed_tensors.config import CompressedTensorsLinearMethod, Scheme

    w, scale = _weights(8, 32, 1, seed=2)
    with torch.device("meta"):
        layer = Linear(32, 8, bias=False, dtype=torch.float32)
    method = CompressedTensorsLinearMethod(Scheme(("Linear",), "channel", None, dynamic, "int-quantized"))
    method.create_weights(layer, 32, [8], 32, 8, torch.float32)
    layer.weight.weight_loader(layer.weight, w, None)
    layer.weight_scale.weight_loader(layer.weight_scale, scale, None)
    method.process_weights_after_loading(layer)
    assert method.kernel is not None and method.kernel.packed is None
    assert method.kernel.weight.device.type == "meta" and method.kernel.scale.device.type == "meta"
    assert layer.qweight.device.type == "meta"


def test_tiny_w8a8_model_on_the_triton_kernels_matches_its_reference(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed-tensors W8A8 checkpoint (made by the library) served with every int8 matmul on the
    interpreted Triton kernels: greedy tokens and top-5 logprobs match transformers running the
    checkpoint's weights dequantized with its inputs quantized per token, as the CPU kernel's test does."""
    if DEVICE != "cpu":
        pytest.skip("drives the interpreter through the CPU platform")
    pytest.importorskip("compressed_tensors")
    from pagoda.testing.model_parity import check_parity

    from .test_compressed_tensors import _tiny_llama, dequantized_reference, make_checkpoint

    path = make_checkpoint(_tiny_llama(), "W8A8", "int-quantized", tmp_path / "ckpt")
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    calls: list[int] = []
    real = triton_kernels.w8a8_matmul
    monkeypatch.setattr(triton_kernels, "w8a8_matmul", lambda *a: calls.append(1) or real(*a))  # counted, still run
    report = check_parity(dequantized_reference(path, dynamic_activations=True), tmp_path, model_path=path,
                          logprob_atol=1e-2)
    assert calls and report.num_tokens_compared >= 40, report
