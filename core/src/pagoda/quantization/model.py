"""Give a built model's layers their quantization methods, and finish them after loading.

Model families build plain ``Linear`` / ``Embedding`` layers (no quantization argument); the model
runner hands the built model to ``quantize_model``, which asks the config for each layer's method
by its name in the model (vLLM's ``prefix``) and lets the method replace the float weight with
its own parameters before any weight is read. The float weights were ``torch.empty``: their pages
were never touched, so dropping them costs no memory.

A family opts in by declaring ``pagoda.models.interface.SupportsQuant`` on its model class: its
``load_weights`` calls a parameter's ``weight_loader(param, loaded_weight, shard_id)`` where the
parameter has one (``shard_id``: the index of the checkpoint tensor within a fused layer, None for a
whole one). An architecture of such a family that cannot names why in ``quant_unsupported_reason``;
the refusal quotes it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagoda.distributed import get_tensor_model_parallel_world_size
from pagoda.layers.embedding import Embedding
from pagoda.layers.linear import Linear
from pagoda.models.interface import quant_unsupported_reason, supports_quant
from pagoda.quantization.base_config import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig

logger = logging.getLogger(__name__)


class TiedEmbeddingLinearMethod(LinearMethodBase):
    """A tied LM head: the logits come from the quantized embedding table it shares."""

    def __init__(self, embedding: Embedding) -> None:
        self.embedding = embedding

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        layer.register_parameter("weight", None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        method = self.embedding.quant_method
        assert isinstance(method, EmbeddingMethodBase)
        return method.apply(self.embedding, x, bias)


def quantize_model(model: nn.Module, quant_config: QuantizationConfig) -> set[str]:
    """Install ``quant_config``'s methods on ``model``'s layers; returns the names of the layers that got one.

    ValueError when the model's family does not load quantized weights.
    """
    if not supports_quant(model):
        reason = quant_unsupported_reason(model)
        if quant_config.dequantize_unsupported:
            logger.warning("%s does not hold quantized layers (%s): the %s weights are dequantized at load",
                           type(model).__name__, reason, quant_config.get_name())
            return set()
        hint = " (quantization='none' loads a GGUF file dequantized)" if quant_config.dequantizable else ""
        raise ValueError(
            f"{type(model).__name__} does not load quantized weights ({reason}); "
            f"{quant_config.get_name()!r} cannot run it{hint}"
        )
    tp_size = get_tensor_model_parallel_world_size()
    if tp_size > 1 and not quant_config.supports_tensor_parallel:
        raise ValueError(f"{quant_config.get_name()!r} quantization runs with tensor_parallel_size=1 only "
                         f"({quant_config.tensor_parallel_unsupported_reason}); tensor_parallel_size={tp_size} asked")
    quant_config.packed_modules_mapping = dict(model.packed_modules_mapping)
    embeddings = {id(m.weight): m for m in model.modules() if isinstance(m, Embedding) and m.weight is not None}
    quantized: set[str] = set()
    tied: list[tuple[str, Linear, Embedding]] = []
    for prefix, module in model.named_modules():
        if isinstance(module, Linear) and module.weight is not None and id(module.weight) in embeddings:
            tied.append((prefix, module, embeddings[id(module.weight)]))
            continue
        if not isinstance(module, (Linear, Embedding)):
            continue
        method = quant_config.get_quant_method(module, prefix)
        if method is None:
            continue
        if isinstance(module, Linear):
            if not isinstance(method, LinearMethodBase):
                raise TypeError(f"{quant_config.get_name()} gave {prefix} (a Linear) a {type(method).__name__}")
            dtype = module.weight.dtype
            # a parallel layer's sizes on this rank and in the checkpoint (a plain Linear: both its own)
            partition_sizes = list(getattr(module, "output_partition_sizes", [module.out_features]))
            output_size = sum(getattr(module, "output_sizes", [module.out_features]))
            method.create_weights(module, module.in_features, partition_sizes,
                                  getattr(module, "input_size", module.in_features), output_size, dtype)
        else:
            if not isinstance(method, EmbeddingMethodBase):
                raise TypeError(f"{quant_config.get_name()} gave {prefix} (an Embedding) a {type(method).__name__}")
            num, dim = module.weight.shape
            method.create_weights(module, num, dim, module.weight.dtype)
        module.quant_method = method
        quantized.add(prefix)
    for prefix, head, embedding in tied:
        # A tied head follows its table: quantized with it, or the plain shared tensor as before.
        if embedding.quant_method is not None:
            head.quant_method = TiedEmbeddingLinearMethod(embedding)
            head.quant_method.create_weights(head)
            quantized.add(prefix)
    return quantized


def process_weights_after_loading(model: nn.Module) -> int:
    """Run every installed method's ``process_weights_after_loading``; returns how many layers have a method."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
            count += 1
    trim_heap()
    return count


def trim_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc keeps it otherwise).

    Quantized weights arrive as many mid-sized tensors that are reordered and concatenated on
    the way: their freed copies stay in glibc's heap, counted as the process's memory,
    measured at 2x the SmolLM2 Q4_1 model's own blocks.
    """
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def checkpoint_module_filter(model: nn.Module, quantized: set[str]) -> Callable[[str], bool] | None:
    """``keep(hf_param_name)``: whether a checkpoint tensor belongs to a quantized layer (None: no layer is).

    Checkpoint names use the unfused layers (``q_proj``); the model's ``packed_modules_mapping``
    maps them onto its fused ones (``qkv_proj``). A family whose parameter names differ from the
    checkpoint's (GPT-NeoX's ``gpt_neox.layers.0.attention.dense``) renames them with its
    ``map_checkpoint_name(name)``.
    """
    if not quantized:
        return None
    # only a SupportsQuant model gets quantized layers (quantize_model)
    assert supports_quant(model)
    fused_of = {part: fused for fused, parts in model.packed_modules_mapping.items() for part in parts}
    rename: Callable[[str], str] = model.map_checkpoint_name

    def keep(name: str) -> bool:
        module = rename(name).rsplit(".", 1)[0]
        if module in quantized:
            return True
        head, _, last = module.rpartition(".")
        fused = fused_of.get(last)
        return fused is not None and (f"{head}.{fused}" if head else fused) in quantized

    return keep
