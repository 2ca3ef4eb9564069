"""fp8 KV cache scales a checkpoint provides: taken out of the weight stream into the attention layers.

Checkpoints quantized for an fp8 KV cache (llm-compressor / compressed-tensors' ``kv_cache_scheme``,
ModelOpt, AutoFP8) store one key and one value scale per attention layer, under the names vLLM
reads (its ``maybe_remap_kv_scale_name``):

* ``<attn>.k_scale`` / ``<attn>.v_scale`` (compressed-tensors; also under ``<attn>.attn.``),
* ``<attn>.k_proj.output_scale`` / ``<attn>.v_proj.output_scale`` (AutoFP8, ModelOpt),
* ``<attn>.kv_scale`` (older: one scale for both).

``<attn>`` is the module holding the layer's ``pagoda.attention.Attention`` (``model.layers.N.self_attn``
in the Llama family) or that layer itself; failing both, the one layer whose ``layer_idx`` is the
name's only number (the transformers fallback keeps its layers in a list). ``CheckpointKVScales.take``
wraps the stream a model's ``load_weights`` reads: each scale goes to its layer (``Attention.load_kv_scale``) and never reaches
the family's loader; every other tensor passes through. A name whose module is not an attention
layer here passes through too (the family then refuses it by name, or skips it on a pipeline stage
that does not hold it). Query / probability scales (``q_scale``, ``prob_scale``: fp8 attention
computation, which pagoda does not run) are refused by name.

As in vLLM, the scales apply only to an fp8 ``kv_cache_dtype`` and only without
``calculate_kv_scales`` (which derives its own): with ``kv_cache_dtype="auto"`` they are read and
ignored (the log says so). One difference: vLLM drops them for a model without a quantization
config; pagoda uses them whatever the checkpoint's quantization.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.attention.layer import Attention

# checkpoint name suffix -> which scales it sets
_SUFFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".k_proj.output_scale", ("k",)),
    (".v_proj.output_scale", ("v",)),
    (".k_scale", ("k",)),
    (".v_scale", ("v",)),
    (".kv_scale", ("k", "v")),
)
_REFUSED = re.compile(r"\.(q_scale|prob_scale|q_proj\.output_scale|prob_output_scale)$")


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(module prefix, scales) a checkpoint name sets, or None when it is no KV cache scale."""
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """A per-tensor scale as a float; per-head or per-channel scales are refused (as vLLM does)."""
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint KV cache scale {name!r} has shape {tuple(tensor.shape)}: only one scale "
                         "per layer (per-tensor) is served for an fp8 KV cache")
    value = float(tensor.reshape(()).float())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint KV cache scale {name!r} is {value}: a scale must be finite and positive")
    return value


class CheckpointKVScales:
    """Routes a checkpoint's KV cache scales to the model's attention layers (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers: dict[str, Attention] = {}
        parents: dict[str, list[Attention]] = {}
        for prefix, module in model.named_modules():
            if isinstance(module, Attention):
                self.layers[prefix] = module
                parents.setdefault(prefix.rpartition(".")[0], []).append(module)
        # a parent names its attention layer only when it holds one
        self.layers.update({parent: held[0] for parent, held in parents.items() if len(held) == 1})
        # a model whose attention layers do not sit where the checkpoint's modules do (the transformers
        # fallback keeps them in a list): the layer index in the name, when each index has one layer
        by_index: dict[int, list[Attention]] = {}
        for layer in {id(a): a for a in self.layers.values()}.values():
            by_index.setdefault(layer.layer_idx, []).append(layer)
        self.by_index = {i: held[0] for i, held in by_index.items() if len(held) == 1}
        self.loaded: dict[str, dict[str, float]] = {}

    def _layer(self, prefix: str) -> Attention | None:
        if prefix.endswith(".attn") and prefix not in self.layers:
            prefix = prefix[: -len(".attn")]
        found = self.layers.get(prefix)
        if found is None:
            numbers = [int(part) for part in prefix.split(".") if part.isdigit()]
            if len(numbers) == 1:
                found = self.by_index.get(numbers[0])
        return found

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without the KV cache scales, which are handed to their layers on the way."""
        for name, tensor in weights:
            if _REFUSED.search(name):
                raise ValueError(f"checkpoint tensor {name!r} is a query / attention-probability scale (fp8 "
                                 "attention computation), which pagoda does not run; only k/v cache scales are read")
            found = kv_scale_target(name)
            layer = None if found is None else self._layer(found[0])
            if found is None or layer is None:
                yield name, tensor
                continue
            value = scale_value(name, tensor)
            scales = self.loaded.setdefault(found[0], {})
            for which in found[1]:
                if which in scales and scales[which] != value:
                    raise ValueError(f"checkpoint gives layer {found[0]!r} two {which}_scale values "
                                     f"({scales[which]} and {value}, the last from {name!r})")
                scales[which] = value
                layer.load_kv_scale(which, value)
        for prefix, scales in self.loaded.items():
            # one of the two given (a lone k_proj.output_scale): vLLM uses it for both
            if len(scales) == 1:
                ((which, value),) = scales.items()
                layer = self._layer(prefix)
                assert layer is not None
                layer.load_kv_scale("v" if which == "k" else "k", value)

    def describe(self) -> str:
        return f"{len(self.loaded)} attention layer(s) with checkpoint k_scale / v_scale"
