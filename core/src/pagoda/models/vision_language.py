"""What every vision-language family shares: a decoder of some registered family behind an encoder.

A VLM here is an encoder (a vision tower and its projector or connector) whose outputs the runner writes over
the prompt's placeholder rows, and a text decoder that any registered family implements (``ModelRegistry``),
built on the checkpoint's ``text_config``. ``VisionLanguageModel`` holds that decoder as ``language_model`` and
forwards the decoder's part of the model contract to it; ``load_weights`` routes each checkpoint tensor to the
decoder's own loader or to the encoder part it names. A family plugin subclasses it and adds its encoder and
``embed_multimodal``; it never imports another family's classes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader
from pagoda.models.interface import SupportsMultiModal, supports_inputs_embeds
from pagoda.models.registry import ModelRegistry

Renames = tuple[tuple[re.Pattern[str], str], ...]


def language_model_class(family: str, text_config: Any, architectures: dict[str, str]) -> type:
    """The registered class that runs ``text_config``: the architecture it names, else the one
    ``architectures`` gives for its ``model_type`` (checkpoints whose text config names none)."""
    archs = list(getattr(text_config, "architectures", None) or [])
    if not archs and text_config.model_type in architectures:
        archs = [architectures[text_config.model_type]]
    if not archs:
        raise ValueError(f"{family}'s text_config (model_type {text_config.model_type!r}) names no architecture")
    cls = ModelRegistry.resolve(archs, "pagoda").load()
    if not supports_inputs_embeds(cls):
        raise ValueError(f"{cls.__name__} cannot run {family}'s decoder: it does not declare SupportsInputsEmbeds")
    return cls


def patch_embedding_as_linear(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A ViT's patch embedding computed as a ``Linear``: the checkpoint's Conv2d weight [hidden, C, p, p] is the
    Linear's [hidden, C * p * p]."""
    if name.endswith("patch_embedding.weight") and tensor.ndim == 4:
        tensor = tensor.reshape(tensor.shape[0], -1)
    yield name, tensor


class VisionLanguageModel(nn.Module, SupportsMultiModal):
    """A family's encoder parts (``encoder_parts``: attribute names, each a module with its own checkpoint
    prefix) beside ``language_model``, the decoder; ``checkpoint_renames`` turn the checkpoint's names (every
    layout transformers has saved) into this model's."""

    family: ClassVar[str] = "this model"
    encoder_parts: ClassVar[tuple[str, ...]] = ()
    checkpoint_renames: ClassVar[Renames] = ()
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    language_model: nn.Module

    @property
    def max_positions(self) -> int:
        return int(self.language_model.max_positions)  # type: ignore[arg-type]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, metadata, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)  # type: ignore[operator]

    def _rename(self, name: str) -> str:
        for pattern, repl in self.checkpoint_renames:
            name = pattern.sub(repl, name)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors go to its own loader (names without ``language_model.``), the rest to the
        encoder part they name; a tensor that fits no part is an error naming it."""
        others: dict[str, list[tuple[str, torch.Tensor]]] = {part: [] for part in self.encoder_parts}
        prefix = "language_model."

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = self._rename(name)
                if name.startswith(prefix):
                    yield name[len(prefix):], tensor
                    continue
                head = name.split(".", 1)[0]
                if head not in others:
                    raise ValueError(f"checkpoint tensor {name!r} fits no part of {self.family}")
                others[head].append((name[len(head) + 1:], tensor))

        loaded = {prefix + n for n in self.language_model.load_weights(decoder_weights())}  # type: ignore[operator]
        for head, tensors in others.items():
            loader = AutoWeightsLoader(getattr(self, head), tensor_mapper=patch_embedding_as_linear)
            loaded |= {f"{head}.{n}" for n in loader.load_weights(tensors)}
        return loaded
