"""What the sampler returns, and its conversion to user-facing logprob records."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagoda.logprobs import Logprob


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled (or prompt) token; columns 1..N the top-N tokens."""

    logprob_token_ids: torch.Tensor  # [B, N + 1] int64
    logprobs: torch.Tensor  # [B, N + 1] float32
    selected_token_ranks: torch.Tensor  # [B] int64, 1 = most likely

    def to_cpu(self) -> LogprobsTensors:
        return LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in self))


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None


def to_sample_logprobs(
    tensors: LogprobsTensors,
    num_logprobs: Sequence[int | None],
    decode: Callable[[int], str] | None = None,
) -> list[dict[int, Logprob] | None]:
    """One dict per batch row for this step (None where the row asked for no logprobs).

    A row that asked for ``k`` logprobs gets the sampled token plus its top-k
    (the sampled token may be one of them, so a dict holds k or k + 1 entries).
    """
    ids = tensors.logprob_token_ids.tolist()
    values = tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    rows: list[dict[int, Logprob] | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            rows.append(None)
            continue
        record: dict[int, Logprob] = {}
        for column in range(1, k + 1):
            token = ids[row][column]
            record[token] = Logprob(values[row][column], column, decode(token) if decode else None)
        sampled = ids[row][0]
        if sampled not in record:
            record[sampled] = Logprob(values[row][0], ranks[row], decode(sampled) if decode else None)
        # The sampled token comes first, as in vLLM's output.
        rows.append({sampled: record.pop(sampled), **record})
    return rows
