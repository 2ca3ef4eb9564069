"""Logprob records returned to users, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log probability of one token, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]
