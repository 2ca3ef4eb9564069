"""LLaVA 1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, and a decoder.

The decoder is whichever registered family implements the text config's architecture (``ModelRegistry``:
a Llama-family class for LLaVA 1.5's Vicuna), built on ``text_config``; it must declare
``SupportsInputsEmbeds`` so the runner can hand it the prompt's embeddings with the images' rows written
over their placeholder tokens (``SupportsMultiModal``: the runner calls ``embed_multimodal`` for the items
the scheduler put in a step, keeps the outputs in its encoder cache, and scatters them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.layers import Activation, Linear
from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader
from pagoda.models.interface import SupportsMultiModal, supports_inputs_embeds
from pagoda.models.registry import ModelRegistry
from pagoda_models_llava.clip import CLIPVisionModel

# text_config.model_type -> the architecture that serves it, for configs whose text_config names none
# (llava-hf's LLaVA 1.5 checkpoints)
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# checkpoint layouts: transformers < 4.52 (vision_tower.vision_model., language_model.model.) and later
# (model.vision_tower., model.language_model., lm_head.) -> this model's names
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^model\.(vision_tower|multi_modal_projector)\."), r"\1."),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
)


def _rename(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def _patch_embedding_as_linear(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    # the checkpoint's Conv2d weight [hidden, 3, p, p] is the Linear's [hidden, 3 * p * p]
    if name.endswith("patch_embedding.weight") and tensor.ndim == 4:
        tensor = tensor.reshape(tensor.shape[0], -1)
    yield name, tensor


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, out_features, bias, dtype)
        self.act = Activation(act)
        self.linear_2 = Linear(out_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _language_model_class(text_config: Any) -> type:
    archs = list(getattr(text_config, "architectures", None) or [])
    if not archs and text_config.model_type in _TEXT_ARCHITECTURES:
        archs = [_TEXT_ARCHITECTURES[text_config.model_type]]
    if not archs:
        raise ValueError(f"LLaVA's text_config (model_type {text_config.model_type!r}) names no architecture")
    cls = ModelRegistry.resolve(archs, "pagoda").load()
    if not supports_inputs_embeds(cls):
        raise ValueError(f"{cls.__name__} cannot run LLaVA's decoder: it does not declare SupportsInputsEmbeds")
    return cls


class LlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vision = hf_config.vision_config
        text = hf_config.text_config
        layer = hf_config.vision_feature_layer
        self.feature_layers: list[int] = list(layer) if isinstance(layer, (list, tuple)) else [int(layer)]
        self.select_strategy = hf_config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not supported "
                             "('default' or 'full')")
        if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vision.model_type} vision tower is not supported (CLIP only)")
        self.vision_tower = CLIPVisionModel(vision, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(self.feature_layers), text.hidden_size,
            bool(getattr(hf_config, "multimodal_projector_bias", True)), hf_config.projector_hidden_act, dtype)
        self.language_model = _language_model_class(text)(text, dtype)
        self.dtype = dtype

    @property
    def max_positions(self) -> int:
        return self.language_model.max_positions

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's projected features: [patches (+ CLS with 'full'), text hidden]."""
        if not items:
            return []
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.dtype)
        states = self.vision_tower(pixels, self.feature_layers)
        features = torch.cat(states, dim=-1)
        if self.select_strategy == "default":
            features = features[:, 1:]  # the CLS token is no image feature
        b, length, hidden = features.shape
        projected = self.multi_modal_projector(features.reshape(b * length, hidden)).view(b, length, -1)
        return list(projected.unbind(0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, metadata, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors go to its own loader (names without ``language_model.``), the rest to the
        tower's and the projector's."""
        others: dict[str, list[tuple[str, torch.Tensor]]] = {"vision_tower": [], "multi_modal_projector": []}
        prefix = "language_model."

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _rename(name)
                if name.startswith(prefix):
                    yield name[len(prefix):], tensor
                    continue
                head = name.split(".", 1)[0]
                if head not in others:
                    raise ValueError(f"checkpoint tensor {name!r} fits no part of LLaVA")
                others[head].append((name[len(head) + 1:], tensor))

        loaded = {prefix + n for n in self.language_model.load_weights(decoder_weights())}
        for head, tensors in others.items():
            loader = AutoWeightsLoader(getattr(self, head), tensor_mapper=_patch_embedding_as_linear)
            loaded |= {f"{head}.{n}" for n in loader.load_weights(tensors)}
        return loaded
