"""The one record a request carries for its multimodal state (vLLM v1's ``MultiModalFeatureSpec``).

The front end fills it (``pagoda.multimodal.processing``); the core reads it in three places, each for one
job: the scheduler (which items to encode this step, under the encoder budget), the prefix cache (each
item's ``identifier`` mixed into the keys of the blocks its placeholders cover) and the model runner (the
processed tensors to encode, and where their outputs go among the prompt's embeddings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


class PlaceholderRange(msgspec.Struct, frozen=True, gc=False):
    """Where one item's placeholder tokens sit in the prompt: ``offset`` .. ``offset + length``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class MultiModalFeature(msgspec.Struct, gc=False):
    """One item (an image): its content hash, its placeholder run and its processed tensors."""

    modality: str
    # hex SHA-256 of the item's pixels and the processor arguments (pagoda.multimodal.hashing): the encoder
    # cache's key, and what the prefix cache mixes into the blocks the item covers
    identifier: str
    placeholder: PlaceholderRange
    # the processor's outputs for this item alone (pixel_values [1, C, H, W], ...), on the host
    data: dict[str, torch.Tensor]

    @property
    def num_embeds(self) -> int:
        """Encoder outputs the item yields: one per placeholder token."""
        return self.placeholder.length


class MultiModalInputs(msgspec.Struct, gc=False):
    """A request's items, in prompt order (their placeholder ranges do not overlap)."""

    features: list[MultiModalFeature]

    def spans(self) -> list[tuple[str, int, int]]:
        """(identifier, offset, length) of each item: what the prefix cache's block keys mix in."""
        return [(f.identifier, f.placeholder.offset, f.placeholder.length) for f in self.features]
