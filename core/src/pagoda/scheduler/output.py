"""What one scheduling step tells the model runner: only what changed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs only after preemption)
    num_prompt_tokens: int
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]  # the request's live output list (the sampler reads it for penalties)
    # Beam search: > 0 makes the runner return this many top next-token candidates
    # instead of sampling (the scheduler picks the beams' tokens).
    num_beam_candidates: int = 0
    beam_temperature: float = 0.0
    # A pooling request: its PoolingParams (no sampling) and the prompt's token type ids, if any.
    pooling_params: Any = None
    token_type_ids: list[int] | None = None


@dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds, in scheduling order."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to the request's table, or its whole table where
    # ``replace_block_ids`` is True (copy-on-write swapped entries in place).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    replace_block_ids: list[bool] = field(default_factory=list)
    # Tokens the scheduler appended that the runner did not sample itself (beam search).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Pipeline parallelism only (else empty): the request's output tokens among those this step computes.
    # Only the last stage samples; a stage before it appends the ones it lacks (vLLM sends the same).
    scheduled_output_token_ids: list[list[int]] = field(default_factory=list)

    def append(self, req_id: str, block_ids: list[int], num_computed: int, replace: bool = False,
               token_ids: list[int] | None = None) -> None:
        self.req_ids.append(req_id)
        self.new_block_ids.append(block_ids)
        self.num_computed_tokens.append(num_computed)
        self.replace_block_ids.append(replace)
        self.new_token_ids.append(token_ids or [])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # requests the runner must forget (finished, aborted or preempted since the last step)
    finished_req_ids: set[str]
    # (src_block, dst_block) KV copies to do before the step (copy-on-write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: req_id -> row of ``grammar_bitmask`` (int32 [rows, ceil(vocab / 32)]) for each
    # constrained request that samples this step; the runner masks its logits with that row.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (batch order): the sampled token ids (empty for a partial prefill chunk)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> list (one per sampled token) of {token_id: Logprob}
    logprobs: dict[str, list[dict[int, Any]]] | None = None
    # req_id -> (index of the first prompt token covered, one entry per prompt token from there;
    # the entry of prompt token 0 is None). A chunk covers the tokens its positions predict.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Any] | None]]] | None = None
    # req_id -> logprob of each sampled token (for cumulative_logprob)
    sampled_logprobs: dict[str, list[float]] | None = None
    # Beam rows: req_id -> (top token ids, their logprobs), best first.
    beam_candidates: dict[str, tuple[list[int], list[float]]] | None = None
    # Pooling runner: per scheduled request (batch order), the pooled tensor once its whole prompt is
    # computed (float32, host), else None.
    pooler_output: list[Any] | None = None


@dataclass
class EngineCoreOutput:
    """What the core reports for one request after a step."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, Any]] | None = None
    new_sampled_logprobs: list[float] | None = None
    new_prompt_logprobs: list[dict[int, Any] | None] | None = None
    num_cached_tokens: int = 0
    # A finished beam search group: its best sequences, best first.
    beam_sequences: list[Any] | None = None
    # Set on a request's first output only: when it was first scheduled (for queue-time metrics).
    first_scheduled_time: float | None = None
    # A finished pooling request: the pooler's tensor for it.
    pooling_output: Any = None
