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
    """Where one item's placeholder tokens sit in the prompt: ``offset`` .. ``offset + length``.

    ``is_embed`` (vLLM's name) marks which of those tokens take the item's encoder outputs, in order; None
    means all of them (LLaVA's one contiguous run). A family whose processor interleaves text tokens with an
    item's image tokens (Idefics3's ``<fake_token_around_image><row_1_col_1><image>...`` tiles) keeps the
    whole span as the placeholder, so chunking, the encoder cache and prefix-cache keys treat it as one item,
    and only the marked rows are overwritten.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"is_embed has {len(self.is_embed)} entries for a placeholder of {self.length} tokens")

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Encoder outputs the item yields: one per marked token."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embeds_in(self, lo: int, hi: int) -> tuple[list[int], int, int]:
        """For prompt positions ``lo`` .. ``hi`` (inside the range): (the positions among them that take
        encoder outputs, relative to ``lo``; the first and one-past-last encoder output row they take)."""
        a, b = lo - self.offset, hi - self.offset
        if self.is_embed is None:
            return list(range(b - a)), a, b
        first = sum(self.is_embed[:a])
        rows = [i - a for i in range(a, b) if self.is_embed[i]]
        return rows, first, first + len(rows)


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
        """Encoder outputs the item yields (its encoder-cache size and encoder-budget cost)."""
        return self.placeholder.num_embeds


class MultiModalInputs(msgspec.Struct, gc=False):
    """A request's items, in prompt order (their placeholder ranges do not overlap)."""

    features: list[MultiModalFeature]

    def spans(self) -> list[tuple[str, int, int]]:
        """(identifier, offset, length) of each item: what the prefix cache's block keys mix in."""
        return [(f.identifier, f.placeholder.offset, f.placeholder.length) for f in self.features]
