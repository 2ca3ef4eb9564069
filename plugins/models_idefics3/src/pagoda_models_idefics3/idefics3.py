"""Idefics3 (``Idefics3ForConditionalGeneration``; SmolVLM is the same class): a SigLIP vision tower, the
connector (pixel shuffle, then one linear), and a decoder.

The decoder is the registered family of the text config's architecture (``ModelRegistry``: Llama for
Idefics3 and SmolVLM), built on ``text_config``; it must declare ``SupportsInputsEmbeds``.

An image is several frames (its tiles in rows and columns, then the whole image scaled down), and its
prompt text interleaves them with text tokens: ``<fake_token_around_image><row_1_col_1><image>*n ...
<fake_token_around_image><global-img><image>*n<fake_token_around_image>``. The item's placeholder is that
whole span, with ``is_embed`` marking the ``<image>`` tokens (``split_mm_items``), so the scheduler,
encoder cache and prefix cache see one item and the runner writes the frames' features only over the
``<image>`` rows.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.layers import Linear
from pagoda.models.vision_language import Renames, VisionLanguageModel, language_model_class
from pagoda.multimodal.inputs import PlaceholderRange
from pagoda_models_idefics3.siglip import Idefics3VisionTransformer

# text_config.model_type -> the architecture that serves it, for configs whose text_config names none
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# the checkpoint's names (transformers' Idefics3ForConditionalGeneration) -> this model's
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^model\.text_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^model\.(vision_model|connector)\."), r"\1."),
)


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(in_features, out_features, False, dtype)


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each ``scale x scale`` block of patches becomes one token of ``scale**2`` times the
    width), then the projection to the decoder's width."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = Idefics3SimpleMLP(vision_hidden * scale_factor**2, text_hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[F, patches, vision hidden] -> [F, patches / scale**2, text hidden]."""
        f, seq, dim = x.shape
        s = self.scale_factor
        side = int(seq**0.5)
        if side * side != seq or side % s:
            raise ValueError(f"a frame of {seq} patches is no square grid divisible by scale_factor {s}")
        # the same element order as transformers' view/permute sequence: rows of s-blocks, columns within
        x = x.view(f, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(f, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        x = x.reshape(f * seq // (s * s), dim * s * s)
        return self.modality_projection.proj(x).view(f, seq // (s * s), -1)


def _item_spans(processor: Any, ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each image's span: from its first ``<fake_token_around_image>`` to the one closing its
    global frame (``<global-img><image>*n<fake_token_around_image>``)."""
    fake, glob, image = processor.fake_image_token_id, processor.global_image_token_id, processor.image_token_id
    spans: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] != fake:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] != glob:
            j += 1
        j += 1
        while j < n and ids[j] == image:
            j += 1
        if j >= n or ids[j] != fake:
            raise ValueError("the prompt's image tokens do not follow Idefics3's layout (a "
                             "<fake_token_around_image> outside an image's expansion?)")
        spans.append((i, j + 1))
        i = j + 1
    return spans


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    family: ClassVar[str] = "Idefics3"
    encoder_parts: ClassVar[tuple[str, ...]] = ("vision_model", "connector")
    checkpoint_renames: ClassVar[Renames] = _RENAMES

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vision = hf_config.vision_config
        text = hf_config.text_config
        self.vision_model = Idefics3VisionTransformer(vision, dtype)
        self.connector = Idefics3Connector(vision.hidden_size, text.hidden_size, hf_config.scale_factor, dtype)
        self.language_model = language_model_class(self.family, text, _TEXT_ARCHITECTURES)(text, dtype)
        self.dtype = dtype

    @classmethod
    def split_mm_items(cls, processor: Any, ids: list[int], outputs: dict[str, torch.Tensor],
                       num_items: int) -> list[tuple[PlaceholderRange, dict[str, torch.Tensor]]]:
        """Each image's span (``is_embed`` on its ``<image>`` tokens) and its frames: one prompt's
        ``pixel_values`` are [1, frames of all its images, C, H, W], each image's ``<image>`` tokens
        ``image_seq_len`` per frame, in order."""
        spans = _item_spans(processor, ids)
        if len(spans) != num_items:
            raise ValueError(f"the prompt expands to {len(spans)} image span(s) for {num_items} image(s): give one "
                             "<image> per image")
        pixels = outputs["pixel_values"]
        mask = outputs.get("pixel_attention_mask")
        per_frame = int(processor.image_seq_len)
        items: list[tuple[PlaceholderRange, dict[str, torch.Tensor]]] = []
        frame = 0
        for start, end in spans:
            is_embed = tuple(t == processor.image_token_id for t in ids[start:end])
            count = sum(is_embed)
            if count % per_frame:
                raise ValueError(f"an image has {count} <image> tokens, not a multiple of image_seq_len {per_frame}")
            frames = count // per_frame
            data = {"pixel_values": pixels[:, frame:frame + frames].contiguous()}
            if mask is not None:
                data["pixel_attention_mask"] = mask[:, frame:frame + frames].contiguous()
            items.append((PlaceholderRange(start, end - start, is_embed), data))
            frame += frames
        if frame > pixels.shape[1]:
            raise ValueError(f"the prompt's images take {frame} frames; the processor made {pixels.shape[1]}")
        return items

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's features, its frames' in order: [frames * image_seq_len, text hidden]."""
        if not items:
            return []
        counts = [int(item["pixel_values"].shape[1]) for item in items]
        pixels = torch.cat([item["pixel_values"].flatten(0, 1) for item in items]).to(self.dtype)
        for item in items:
            mask = item.get("pixel_attention_mask")
            if mask is not None and not bool(mask.all()):
                raise ValueError("an image frame has padded pixels (pixel_attention_mask); Idefics3's processor "
                                 "makes full frames, and masked frames are not supported")
        features = self.connector(self.vision_model(pixels))
        return [f.reshape(-1, f.shape[-1]) for f in features.split(counts)]
