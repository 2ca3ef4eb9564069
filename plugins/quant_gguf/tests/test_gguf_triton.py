"""The Triton dequantize-matmul on GGUF blocks against the torch reference (dequantize, then matmul),
for every block type, run under ``TRITON_INTERPRET=1`` where there is no GPU (conftest)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from pagoda_quant_gguf import config, triton_path
from pagoda_quant_gguf.dequant import block_size, dequantize_blocks

from .test_gguf_kernels import BASIC, K_QUANT_SCALES, random_k_blocks

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)

from pagoda_quant_gguf import triton_kernels  # noqa: E402  (after TRITON_INTERPRET is settled)

ALL_TYPES = BASIC + list(K_QUANT_SCALES)


def _blocks(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    if qtype in K_QUANT_SCALES:
        return torch.from_numpy(random_k_blocks(qtype, n, k // 256))
    weight = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(quantize(weight, qtype))


def _case(qtype: Q, m: int, n: int = 45, k: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = _blocks(qtype, n, k, seed=m)
    x = torch.from_numpy(np.random.default_rng(m + 100).standard_normal((m, k)).astype(np.float32))
    reference = x @ dequantize_blocks(blocks, int(qtype), k).T
    return blocks.to(DEVICE), x.to(DEVICE), reference


def _rel_err(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.cpu() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 19])  # decode (one row in a 16-row tile) and two M tiles
def test_triton_matches_torch_reference(qtype: Q, m: int) -> None:
    blocks, x, reference = _case(qtype, m)
    y = triton_kernels.matmul(x, blocks, int(qtype), x.shape[1])
    assert y.dtype == torch.float32 and y.shape == reference.shape
    # float32 activations multiply the decoded weight exactly (no TF32): only summation order differs
    assert _rel_err(y, reference) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
def test_16_bit_activations(qtype: Q, dtype: torch.dtype) -> None:
    """fp16 takes the 16-bit dot (weight rounded to x's dtype); bf16 too on a GPU, the float32 one interpreted."""
    blocks, x, reference = _case(qtype, 3)
    x16 = x.to(dtype)
    weight = dequantize_blocks(blocks.cpu(), int(qtype), x.shape[1])
    if dtype == torch.float16 or DEVICE == "cuda":
        weight = weight.to(dtype).float()
    expected = x16.float().cpu() @ weight.T
    y = triton_kernels.matmul(x16, blocks, int(qtype), x.shape[1])
    # against the operands as the kernel rounds them: float32 sums differ in order only
    assert _rel_err(y, expected) < 1e-4
    # and against float32 x: the rounding of both operands, measured ~0.3% (fp16) / ~0.6% (bf16)
    assert _rel_err(y, reference) < 0.02


def test_bad_shapes_and_types_are_refused() -> None:
    blocks, x, _ = _case(Q.Q4_0, 1)
    with pytest.raises(ValueError, match="do not hold"):
        triton_kernels.matmul(x[:, :480], blocks, int(Q.Q4_0), 480)
    with pytest.raises(ValueError, match="no path for type F16"):
        triton_kernels.matmul(x, blocks, int(Q.F16), x.shape[1])
    with pytest.raises(ValueError, match="activations"):
        triton_kernels.matmul(x.double(), blocks, int(Q.Q4_0), x.shape[1])


def test_layer_takes_triton_when_asked_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's matmul: on CPU tensors Triton runs only under PAGODA_KERNELS_IMPL=triton (the C++ kernel otherwise)."""
    if DEVICE != "cpu":
        pytest.skip("checks the CPU dispatch")
    blocks, x, reference = _case(Q.Q8_0, 2)
    shards = [config.Shard(int(Q.Q8_0), blocks)]
    monkeypatch.delenv("PAGODA_KERNELS_IMPL", raising=False)  # the defaults, whatever this run set
    monkeypatch.delenv("PAGODA_GGUF_KERNEL", raising=False)  # the defaults, whatever this run set
    assert not triton_path.supports(int(Q.Q8_0), x)
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    assert triton_path.supports(int(Q.Q8_0), x)
    # the C++ kernel quantizes x to int8 (~0.5% off); Triton keeps float32 products (~1e-7)
    assert _rel_err(config.matmul(shards, x, x.shape[1]), reference) < 1e-5
    monkeypatch.setenv("PAGODA_GGUF_KERNEL", "0")
    assert not triton_path.supports(int(Q.Q8_0), x)
    monkeypatch.setenv("PAGODA_GGUF_KERNEL", "1")
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "torch")
    assert not triton_path.supports(int(Q.Q8_0), x)


@pytest.mark.parametrize("target", ["cuda-sm90", "rocm-gfx942"])
def test_kernel_compiles_for_gpus(target: str) -> None:
    """Every block type lowered by Triton's compiler for an H100 and an MI300 (no device needed): what the
    interpreter cannot check (constexpr branches, bitcasts, tl.dot operand types). Both dot branches:
    float32 activations on even codes, bf16 / fp16 on odd ones."""
    from pagoda.testing.triton_compile import KernelCase, compile_for_target

    cases = []
    for qtype, code in triton_kernels._CODES.items():
        values, nbytes = block_size(qtype)
        x = ("*fp32", "*bf16", "*fp16")[code % 3] if code % 2 else "*fp32"
        cases.append(KernelCase(
            name=Q(qtype).name, module=triton_kernels.__name__, kernel="_gguf_matmul_kernel",
            signature={"x_ptr": x, "w_ptr": "*u8", "y_ptr": "*fp32", "M": "i32", "N": "i32", "num_blocks": "i32",
                       "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", **dict.fromkeys(
                           ("QTYPE", "QK", "BLOCK_BYTES", "BLOCK_M", "BLOCK_N", "IEEE"), "constexpr")},
            constexprs={"QTYPE": code, "QK": values, "BLOCK_BYTES": nbytes, "BLOCK_M": 16,
                        "BLOCK_N": 64 if values == 32 else 32, "IEEE": x == "*fp32"}))
    results = compile_for_target(cases, target)
    assert results == {c.name: "ok" for c in cases}


def test_blocks_go_to_the_models_device() -> None:
    """The loader reads blocks into host memory; a layer built on another device (a GPU; here ``meta``, which
    holds no data) gets them there, in the stored layout (the CPU kernel's repacking is for CPU layers)."""
    from pagoda.layers import Linear

    blocks = _blocks(Q.Q4_0, 8, 64, seed=1)
    with torch.device("meta"):
        layer = Linear(64, 8, bias=False, dtype=torch.float32)
    method = config.GGUFLinearMethod()
    method.create_weights(layer, 64, [8], 64, 8, torch.float32)
    layer.qweight.weight_loader(layer.qweight, torch.tensor(int(Q.Q4_0)), None)
    layer.qweight.weight_loader(layer.qweight, blocks, None)
    method.process_weights_after_loading(layer)
    assert [(s.blocks.device.type, s.packed) for s in method.shards] == [("meta", False)]
    assert layer.qweight.device.type == "meta"


@pytest.mark.parametrize("qtype", [Q.Q4_K], ids=lambda q: q.name)  # one type: ~45 s interpreted
def test_tiny_model_on_the_triton_kernel_equals_the_dequantized_model(tmp_path: Path, qtype: Q,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama GGUF file served kept in blocks with every matmul on the Triton kernel (interpreted on
    CPU tensors) against the same file dequantized at load: the kernel keeps activations in float32, so
    the logits agree to float rounding. Measured (max error / max |logit|): Q4_K 5.5e-7, Q5_1 1.8e-6; the
    CPU kernel, whose activations are int8, 0.18 and 5.9e-4 on the same files."""
    if DEVICE != "cpu":
        pytest.skip("drives the interpreter through the CPU platform")
    from .test_gguf_models import prompt_logits, write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype)
    dequantized = prompt_logits(path, "none", "float32")
    monkeypatch.setenv("PAGODA_KERNELS_IMPL", "triton")
    calls: list[int] = []
    real = triton_kernels.matmul
    monkeypatch.setattr(triton_kernels, "matmul", lambda *a: calls.append(a[2]) or real(*a))  # counted, still run
    kept = prompt_logits(path, "gguf", "float32")
    assert calls and set(calls) == {int(qtype)}
    scale = np.abs(dequantized).max()
    assert np.abs(kept - dequantized).max() < 1e-4 * scale, (np.abs(kept - dequantized).max(), scale)
