"""Request outputs with vLLM's shapes and names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.engine.messages import PredictionCounts


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # predicted outputs: the sequence's accepted / rejected prediction tokens (None: no prediction)
    prediction: PredictionCounts | None = None

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


# -- pooling outputs (vLLM's classes) ---------------------------------------------------------------


@dataclass
class PoolingOutput:
    """The pooler's result for one prompt: a tensor (float32 on the host), e.g. [hidden] or [tokens, hidden]."""

    data: Any  # torch.Tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolingOutput) and bool((self.data == other.data).all())


@dataclass
class PoolingRequestOutput:
    """What a pooling request ends with (``LLM.encode``, ``AsyncLLM.encode``); vLLM's fields and order."""

    request_id: str
    outputs: Any  # PoolingOutput, or EmbeddingOutput / ClassificationOutput / ScoringOutput in the subclasses
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    # the prompt's text where the request had one (pagoda keeps it; vLLM does not)
    prompt: str | None = None


def _vector(data: Any, what: str) -> Any:
    if data.ndim != 1:
        raise ValueError(f"pooled_data should be a 1-D {what} vector, got shape {tuple(data.shape)}")
    return data


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(_vector(pooling_output.data, "embedding").tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_output.request_id, EmbeddingOutput.from_base(request_output.outputs),
            request_output.prompt_token_ids, request_output.num_cached_tokens, request_output.finished,
            request_output.prompt,
        )


@dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(_vector(pooling_output.data, "probability").tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            request_output.request_id, ClassificationOutput.from_base(request_output.outputs),
            request_output.prompt_token_ids, request_output.num_cached_tokens, request_output.finished,
            request_output.prompt,
        )


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        data = pooling_output.data
        if data.numel() != 1:
            raise ValueError(f"a score is one number; the pooler gave shape {tuple(data.shape)} "
                             "(a classifier with more than one label cannot score pairs)")
        return ScoringOutput(float(data.reshape(()).item()))


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(
            request_output.request_id, ScoringOutput.from_base(request_output.outputs),
            request_output.prompt_token_ids, request_output.num_cached_tokens, request_output.finished,
            request_output.prompt,
        )
