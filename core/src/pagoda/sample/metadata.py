"""The tensors one sampler step needs, gathered for the rows of that step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class PenaltyTensors:
    """Penalties for the batch rows listed in ``rows`` (a subset of the batch)."""

    rows: torch.Tensor  # [P] int64 batch indices
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    output_counts: torch.Tensor  # [P, V] float32, occurrences of each token in the output
    # [P, V] bool, token occurs in prompt; None when no row has a repetition penalty.
    prompt_mask: torch.Tensor | None


@dataclass
class ProcessorCall:
    """Per-request logits processors for one batch row, each with whether it takes the prompt."""

    batch_index: int
    processors: list[tuple[Callable[..., torch.Tensor], bool]]
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]


@dataclass
class SamplingMetadata:
    """Batch row ``i`` of the logits is described by entry ``i`` of every tensor.

    Optional parts are None when no row of the step uses them, so the sampler
    skips their work entirely; the flags are computed on the host, so the
    sampler never synchronizes with the device to take a branch.
    """

    # [B] float32; greedy rows carry 1.0 so dividing is harmless. None when all greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only when greedy and random rows mix
    top_p: torch.Tensor | None  # [B] float32
    top_k: torch.Tensor | None  # [B] int64; rows without top-k carry the vocab size
    max_top_k: int  # the largest active top-k (0 when none)
    min_p: torch.Tensor | None  # [B] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch index -> generator
    # None when no row asked for logprobs; else the largest count asked (may be 0).
    max_num_logprobs: int | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    penalties: PenaltyTensors | None = None
    # Rows restricted to allowed_token_ids: (batch indices [A], banned mask [A, V]).
    allowed_rows: torch.Tensor | None = None
    disallowed_mask: torch.Tensor | None = None
    # (batch index, token) pairs forced to -inf: bad words and min_tokens.
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # (batch index, token, bias) triples for logit_bias.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    processor_calls: list[ProcessorCall] = field(default_factory=list)

    @property
    def needs_constraints(self) -> bool:
        return (
            self.penalties is not None
            or self.allowed_rows is not None
            or self.banned_rows is not None
            or self.bias_rows is not None
            or bool(self.processor_calls)
        )
