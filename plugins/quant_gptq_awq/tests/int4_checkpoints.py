"""Writes GPTQ and AWQ checkpoints of tiny transformers models, packed here from the formats' descriptions.

Independent of the plugin's unpacking code on purpose: the packing below follows AutoGPTQ's and
AutoAWQ's writers (qweight / qzeros int32, scales fp16, g_idx int32), and each checkpoint comes with
the float model holding exactly the weights it stores, dequantized (the transformers reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column AWQ_ORDER[j] of its eight
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits."""
    return ((values + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_along_rows(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ qweight: [K, N] values -> [K / p, N] (p = 32 / bits), row p i + j in field j of row i."""
    p = 32 // bits
    words = torch.zeros(q.shape[0] // p, q.shape[1], dtype=torch.int64)
    for j in range(p):
        words |= q[j::p].long() << (bits * j)
    return _int32(words)


def pack_along_columns(values: torch.Tensor, order: list[int], bits: int = 4) -> torch.Tensor:
    """[R, N] values -> [R, N / p]: field j of word i holds column p i + order[j]."""
    p = 32 // bits
    words = torch.zeros(values.shape[0], values.shape[1] // p, dtype=torch.int64)
    for j in range(p):
        words |= (values[:, order[j]::p].long() & ((1 << bits) - 1)) << (bits * j)
    return _int32(words)


@dataclass
class Quantized:
    q: torch.Tensor  # [K, N] 0..15
    zeros: torch.Tensor  # [G, N] 0..15 (the true zero points)
    scales: torch.Tensor  # [G, N] float16
    g_idx: torch.Tensor  # [K] int32
    dequantized: torch.Tensor  # [N, K] float32

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])


def quantize(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None, sym: bool = False,
             min_zero: int = 0, bits: int = 4) -> Quantized:
    """Min-max ``bits``-bit quantization of ``weight`` [N, K] per group of input channels (``g_idx``: act order)."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(k) // size
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    w = weight.t().float()  # [K, N]
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        rows = w[g_idx == g]
        if sym:
            scale = rows.abs().amax(0) * 2 / maxq
            zero = torch.full((n,), float((maxq + 1) // 2))
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / scale)
        scales[g] = scale.clamp(min=1e-6)
        zeros[g] = zero.clamp(min_zero, maxq)
    scales16 = scales.half()
    s = scales16.float()[g_idx.long()]
    z = zeros[g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq)
    dequantized = ((q - z) * s).t().contiguous()
    return Quantized(q.to(torch.uint8), zeros.to(torch.int64), scales16, g_idx.to(torch.int32), dequantized)


def gptq_tensors(qz: Quantized, bits: int = 4) -> dict[str, torch.Tensor]:
    """AutoGPTQ's v1 layout: zeros stored minus one."""
    return {"qweight": pack_along_rows(qz.q, bits),
            "qzeros": pack_along_columns(qz.zeros - 1, list(range(32 // bits)), bits),
            "scales": qz.scales, "g_idx": qz.g_idx}


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_columns(qz.q.long(), AWQ_ORDER), "qzeros": pack_along_columns(qz.zeros, AWQ_ORDER),
            "scales": qz.scales}


def write_checkpoint(model: Any, path: Path, method: str, group_size: int, *, desc_act: bool = False,
                     sym: bool = False, skip: tuple[str, ...] = (), lm_head: bool = False, seed: int = 0,
                     bits: int = 4) -> Path:
    """Quantize ``model``'s decoder Linears (not those named in ``skip``; ``lm_head`` too when asked) into a
    ``method`` checkpoint under ``path``; ``model``'s weights become the dequantized ones (the reference)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            wanted = (leaf in QUANTIZED and not any(s in name for s in skip)) or (lm_head and name == "lm_head")
            if not wanted or not isinstance(module, torch.nn.Linear):
                continue
            k = module.in_features
            g_idx = None
            if desc_act:  # act order: each projection's input channels in their own order, grouped in that order
                perm = torch.randperm(k, generator=gen)
                g_idx = torch.empty(k, dtype=torch.int64)
                g_idx[perm] = torch.arange(k) // (k if group_size == -1 else group_size)
            qz = quantize(module.weight, group_size, g_idx, sym=sym, min_zero=1 if method == "gptq" else 0, bits=bits)
            tensors = gptq_tensors(qz, bits) if method == "gptq" else awq_tensors(qz)
            del state[f"{name}.weight"]
            state.update({f"{name}.{key}": value.contiguous() for key, value in tensors.items()})
            module.weight.copy_(qz.dequantized)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [type(model).__name__]
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                 "lm_head": lm_head, "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01}
        if skip:  # GPTQ names what it quantizes in each block
            quant["modules_in_block_to_quantize"] = [[f"{'self_attn' if p in QUANTIZED[:4] else 'mlp'}.{p}"
                                                      for p in QUANTIZED if p not in skip]]
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                 "backend": "autoawq", "modules_to_not_convert": list(skip) or None}
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
