"""Logit edits that come before sampling: allowed tokens, bans, bias, processors, penalties.

Each function edits ``logits`` ([B, V] float32) in place.
"""

from __future__ import annotations

import torch

from pagoda.sample.metadata import PenaltyTensors, ProcessorCall, SamplingMetadata


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor, disallowed_mask: torch.Tensor) -> None:
    logits[rows] = logits[rows].masked_fill_(disallowed_mask, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
    logits.index_put_((rows, tokens), values, accumulate=True)


def apply_logits_processors(logits: torch.Tensor, calls: list[ProcessorCall]) -> None:
    for call in calls:
        row = logits[call.batch_index]
        for processor, takes_prompt in call.processors:
            if takes_prompt:
                row = processor(call.prompt_token_ids, call.output_token_ids, row)
            else:
                row = processor(call.output_token_ids, row)
        logits[call.batch_index] = row


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Repetition (prompt + output, HF semantics), then frequency and presence (output only)."""
    rows = penalties.rows
    sub = logits[rows]
    counts = penalties.output_counts
    output_mask = counts > 0
    if penalties.prompt_mask is not None:
        seen = output_mask | penalties.prompt_mask
        repetition = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        sub = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub -= penalties.frequency.unsqueeze(1) * counts
    sub -= penalties.presence.unsqueeze(1) * output_mask
    logits[rows] = sub


def apply_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Everything before greedy/random selection, in vLLM's order."""
    if metadata.allowed_rows is not None and metadata.disallowed_mask is not None:
        apply_allowed_token_ids(logits, metadata.allowed_rows, metadata.disallowed_mask)
    if metadata.banned_rows is not None and metadata.banned_tokens is not None:
        apply_banned_tokens(logits, metadata.banned_rows, metadata.banned_tokens)
    if metadata.bias_rows is not None and metadata.bias_tokens is not None and metadata.bias_values is not None:
        apply_logit_bias(logits, metadata.bias_rows, metadata.bias_tokens, metadata.bias_values)
    if metadata.processor_calls:
        apply_logits_processors(logits, metadata.processor_calls)
    if metadata.penalties is not None:
        apply_penalties(logits, metadata.penalties)
