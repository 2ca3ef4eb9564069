"""The ``gptq`` and ``awq`` methods: 4-bit checkpoints read from ``config.json``'s ``quantization_config`` as vLLM reads them.

* ``gptq`` (vLLM's ``GPTQConfig``): ``bits``, ``group_size`` (-1: one group), ``desc_act`` (act
  order, ``g_idx``), ``sym``, ``lm_head``, ``dynamic``, ``checkpoint_format``,
  ``modules_in_block_to_quantize``.
* ``awq`` (vLLM's ``AWQConfig``): ``w_bit`` / ``bits``, ``q_group_size`` / ``group_size``,
  ``zero_point``, ``modules_to_not_convert``, and transformers' ``version`` / ``backend``.

Served: 4-bit weights (GPTQ also 8-bit), GPTQ ``checkpoint_format`` ``gptq`` (and ``gptq_v2``), AWQ's GEMM version.
Everything else is refused with the reason rather than loaded wrong: other bit widths (GPTQ 2 / 3, AWQ 8), GPTQ's
per-module ``dynamic`` overrides and Marlin-packed checkpoints, AWQ's GEMV / Marlin / ExLlama / IPEX
versions, llm-awq's layout and AWQ without zero points.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from pagoda.quantization import QuantizationConfig, QuantizeMethodBase
from pagoda_quant_gptq_awq import cpu_int8_kernel, cpu_kernel
from pagoda_quant_gptq_awq.linear import Int4LinearMethod, kernel_for

PLUGIN = "pagoda-quant-gptq-awq"
ACT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROUTER_GATES = ("gate", "shared_expert_gate")


def _group_size(method: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise ValueError(f"{method} group_size {value!r}: a positive number of input channels, or -1 for one group")
    return value


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"{method} checkpoint with {what} is not supported by {PLUGIN} "
                      "(it serves 4- and 8-bit GPTQ in AutoGPTQ's layout and 4-bit AWQ in AutoAWQ's GEMM layout)")


class _Int4Config(QuantizationConfig):
    """What the two methods share: which layers are quantized, and naming the kernels in the log."""

    format: str
    desc_act = False  # GPTQ's act order (AWQ has none)
    supports_tensor_parallel = True  # each rank loads its slice (linear._collector)

    def __init__(self, weight_bits: int, group_size: int, zero_offset: int) -> None:
        super().__init__()
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_offset = zero_offset
        self._kernels: set[str] = set()

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return list(ACT_DTYPES)

    @abstractmethod
    def _layer_quantized(self, name: str) -> bool:
        """Whether the checkpoint layer ``name`` (unfused) is stored quantized."""

    def is_layer_skipped(self, prefix: str) -> bool:
        names = self.checkpoint_layer_names(prefix)
        kept = [not self._layer_quantized(name) for name in names]
        if any(kept) and not all(kept):
            raise ValueError(f"{self.get_name()} quantizes some of {names} but not all: the fused layer {prefix} "
                             "cannot be half quantized")
        return all(kept)

    def _quantizes_lm_head(self) -> bool:
        return False

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagoda.layers import Linear
        from pagoda.layers.vocab_parallel_embedding import ParallelLMHead

        if not isinstance(layer, Linear):
            return None  # embeddings stay float in both formats
        if isinstance(layer, ParallelLMHead) and not self._quantizes_lm_head():
            return None
        if prefix.rpartition(".")[2] in ROUTER_GATES:
            return None  # MoE routers stay float (vLLM builds them without a quant_config)
        if self.is_layer_skipped(prefix):
            return None
        self._kernels.add(kernel_for(layer.weight.device if layer.weight is not None else torch.device("cpu"),
                                     self.weight_bits))
        return Int4LinearMethod(self.format, self.group_size, self.zero_offset, self.weight_bits,  # type: ignore[arg-type]
                                self.desc_act)

    def describe(self) -> str:
        names = {"cpu": cpu_kernel.describe() if self.weight_bits == 4 else cpu_int8_kernel.describe(), "triton": "Triton dequantize-matmul",
                 "torch": "torch reference (dequantized per call)"}
        kernels = ", ".join(names[k] for k in sorted(self._kernels)) or "no layer"
        group = "one group" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"quantization: {self.get_name()} ({self.weight_bits}-bit, {group}{self._details()}; {kernels})"

    def _details(self) -> str:
        return ""


class GPTQConfig(_Int4Config):
    """vLLM's ``GPTQConfig`` for 4-bit checkpoints in AutoGPTQ's layout."""

    format = "gptq"

    def __init__(self, weight_bits: int, group_size: int, desc_act: bool, lm_head_quantized: bool,
                 checkpoint_format: str, modules_in_block_to_quantize: list[str] | None) -> None:
        super().__init__(weight_bits, group_size, 0 if checkpoint_format == "gptq_v2" else 1)
        self.desc_act = desc_act
        self.lm_head_quantized = lm_head_quantized
        self.checkpoint_format = checkpoint_format
        self.modules_in_block_to_quantize = modules_in_block_to_quantize or []

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = cls.get_from_keys(config, ["bits"])
        if bits not in (4, 8):
            raise _refuse("gptq", f"{bits}-bit weights")
        group_size = _group_size("gptq", cls.get_from_keys(config, ["group_size"]))
        desc_act = bool(cls.get_from_keys(config, ["desc_act"]))
        dynamic = cls.get_from_keys_or(config, ["dynamic"], {}) or {}
        if dynamic:
            raise _refuse("gptq", f"per-module overrides (dynamic: {sorted(dynamic)})")
        checkpoint_format = cls.get_from_keys_or(config, ["checkpoint_format"], "") or "gptq"
        if checkpoint_format not in ("gptq", "gptq_v2") or config.get("is_marlin_format"):
            raise _refuse("gptq", f"checkpoint_format {checkpoint_format!r}"
                          f"{' (is_marlin_format)' if config.get('is_marlin_format') else ''}")
        lm_head = bool(cls.get_from_keys_or(config, ["lm_head"], False))
        modules = cls.get_from_keys_or(config, ["modules_in_block_to_quantize"], None)
        flat: list[str] | None = None
        if modules:
            # transformers writes a list of lists (the blocks' sequential steps); vLLM flattens it
            flat = [m for item in modules for m in (item if isinstance(item, list) else [item])]
        return cls(bits, group_size, desc_act, lm_head, checkpoint_format, flat)

    def _layer_quantized(self, name: str) -> bool:
        if not self.modules_in_block_to_quantize:
            return True
        return any(module in name for module in self.modules_in_block_to_quantize)

    def _quantizes_lm_head(self) -> bool:
        return self.lm_head_quantized

    def _details(self) -> str:
        return (f"{', desc_act' if self.desc_act else ''}, {self.checkpoint_format}"
                f"{', lm_head' if self.lm_head_quantized else ''}")


class AWQConfig(_Int4Config):
    """vLLM's ``AWQConfig`` for 4-bit checkpoints in AutoAWQ's GEMM layout."""

    format = "awq"

    def __init__(self, weight_bits: int, group_size: int, zero_point: bool,
                 modules_to_not_convert: list[str] | None) -> None:
        super().__init__(weight_bits, group_size, 0)
        self.zero_point = zero_point
        self.modules_to_not_convert = modules_to_not_convert or []

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = cls.get_from_keys(config, ["w_bit", "bits"])
        if bits != 4:
            raise _refuse("awq", f"{bits}-bit weights")
        group_size = _group_size("awq", cls.get_from_keys(config, ["q_group_size", "group_size"]))
        zero_point = bool(cls.get_from_keys(config, ["zero_point"]))
        if not zero_point:
            raise _refuse("awq", "zero_point false (symmetric AWQ)")
        version = str(cls.get_from_keys_or(config, ["version"], "gemm")).lower()
        if version != "gemm":
            raise _refuse("awq", f"version {version!r} (its packing differs from the GEMM version's)")
        backend = str(cls.get_from_keys_or(config, ["backend"], "autoawq")).lower()
        if backend not in ("autoawq", "auto"):
            raise _refuse("awq", f"backend {backend!r} (llm-awq packs its weights differently)")
        modules = cls.get_from_keys_or(config, ["modules_to_not_convert"], None)
        return cls(bits, group_size, zero_point, list(modules) if modules else None)

    def _layer_quantized(self, name: str) -> bool:
        # vLLM's is_layer_skipped_awq: a listed name anywhere in the layer's name
        return not any(module in name for module in self.modules_to_not_convert)
