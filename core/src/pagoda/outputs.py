"""Request outputs with vLLM's shapes and names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Any] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] | None = None
    kv_transfer_params: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
