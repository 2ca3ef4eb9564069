"""LLaVA 1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, and a decoder.

The decoder is whichever registered family implements the text config's architecture (``ModelRegistry``:
a Llama-family class for LLaVA 1.5's Vicuna), built on ``text_config``; it must declare
``SupportsInputsEmbeds`` so the runner can hand it the prompt's embeddings with the images' rows written
over their placeholder tokens (``SupportsMultiModal``: the runner calls ``embed_multimodal`` for the items
the scheduler put in a step, keeps the outputs in its encoder cache, and scatters them).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.layers import Activation, Linear
from pagoda.models.vision_language import Renames, VisionLanguageModel, language_model_class
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


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, out_features, bias, dtype)
        self.act = Activation(act)
        self.linear_2 = Linear(out_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    family: ClassVar[str] = "LLaVA"
    encoder_parts: ClassVar[tuple[str, ...]] = ("vision_tower", "multi_modal_projector")
    checkpoint_renames: ClassVar[Renames] = _RENAMES

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
        self.language_model = language_model_class(self.family, text, _TEXT_ARCHITECTURES)(text, dtype)
        self.dtype = dtype

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
