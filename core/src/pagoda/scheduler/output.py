"""The messages of one step inside the core: what the scheduler tells the model runner (only what changed),
and what the runner hands back.

A per-request feature the runner needs adds one optional sub-record to ``NewRequestData`` (filled in
``NewRequestData.from_request``) and its reader in the runner; everything else travels inside ``params``.
The front end <-> core messages are in ``pagoda.engine.messages``. Both are ``msgspec.Struct``s: with
several ranks every step's ``SchedulerOutput`` is pickled to the workers and their ``ModelRunnerOutput``
pickled back, and a Struct pickles in C.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

    from pagoda.logprobs import Logprob
    from pagoda.lora.request import LoRARequest
    from pagoda.multimodal.inputs import MultiModalFeature
    from pagoda.pooling_params import PoolingParams
    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduler.request import Request


class BeamCandidates(msgspec.Struct, frozen=True, gc=False):
    """A beam search row: the runner returns its top next-token candidates instead of sampling
    (the scheduler's beam search picks the tokens)."""

    num_candidates: int
    # the candidates are ranked by log_softmax(logits / temperature); 0: no scaling
    temperature: float


class GrammarBitmask(msgspec.Struct, gc=False):
    """The allowed next tokens of the constrained requests that sample this step."""

    # req_id -> its row of ``bitmask``
    request_rows: dict[str, int]
    # int32 [rows, ceil(vocab / 32)]: bit t of a row allows token t; the runner masks the logits with it
    bitmask: torch.Tensor


class NewRequestData(msgspec.Struct, gc=False):
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs only after preemption)
    num_prompt_tokens: int
    params: SamplingParams | PoolingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]  # the request's live output list (the sampler reads it for penalties)
    beam: BeamCandidates | None = None
    # the prompt's token type ids (BERT-style pair encodings), if the request has them
    token_type_ids: list[int] | None = None
    # the adapter the request runs with (the runner puts it in a slot); None: the base model
    lora_request: LoRARequest | None = None
    # multimodal items (their processed tensors and placeholder ranges); None: a text-only request
    mm_features: list[MultiModalFeature] | None = None

    @classmethod
    def from_request(cls, req: Request, block_ids: list[int], beam: BeamCandidates | None) -> NewRequestData:
        return cls(req_id=req.request_id, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                   params=req.params, block_ids=block_ids, num_computed_tokens=req.num_computed_tokens,
                   output_token_ids=req.output_token_ids, beam=beam, token_type_ids=req.token_type_ids,
                   lora_request=req.lora_request, mm_features=req.mm_features or None)


class CachedRequestData(msgspec.Struct, gc=False):
    """The diff for one request the runner already holds."""

    req_id: str
    # Blocks appended to the request's table, or its whole table where ``replace_block_ids``
    # (copy-on-write swapped entries in place).
    new_block_ids: list[int]
    num_computed_tokens: int
    replace_block_ids: bool = False
    # Tokens the scheduler appended that the runner did not sample itself (beam search).
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    # Pipeline parallelism only (else None): the request's output tokens among those this step computes.
    # Only the last stage samples; a stage before it appends the ones it lacks (vLLM sends the same).
    scheduled_output_token_ids: list[int] | None = None


class SchedulerOutput(msgspec.Struct, gc=False):
    scheduled_new_reqs: list[NewRequestData]
    # in scheduling order
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # requests the runner must forget (finished, aborted or preempted since the last step)
    finished_req_ids: set[str]
    # (src_block, dst_block) KV copies to do before the step (copy-on-write)
    block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # structured outputs: set when a constrained request samples this step
    grammar: GrammarBitmask | None = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (vLLM's name). They
    # are among the request's ``num_scheduled_tokens``; the runner verifies them and returns the accepted
    # ones plus one token of its own in ``sampled_token_ids``.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Multimodal (vLLM's names): req_id -> indices of its items to encode this step (their outputs go to the
    # runner's encoder cache before the forward), and the encoder cache entries the runner drops first.
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, gc=False):
    """Per scheduled request (batch order): the sampled token ids (empty for a partial prefill chunk)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> list (one per sampled token) of {token_id: Logprob}
    logprobs: dict[str, list[dict[int, Logprob]]] | None = None
    # req_id -> (index of the first prompt token covered, one entry per prompt token from there;
    # the entry of prompt token 0 is None). A chunk covers the tokens its positions predict.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob] | None]]] | None = None
    # req_id -> logprob of each sampled token (for cumulative_logprob)
    sampled_logprobs: dict[str, list[float]] | None = None
    # Beam rows: req_id -> (top token ids, their logprobs), best first.
    beam_candidates: dict[str, tuple[list[int], list[float]]] | None = None
    # Pooling runner: per scheduled request (batch order), the pooled tensor once its whole prompt is
    # computed (float32, host), else None.
    pooler_output: list[torch.Tensor | None] | None = None

    @classmethod
    def empty(cls, req_ids: list[str]) -> ModelRunnerOutput:
        """Nothing sampled for these requests (a stage before the last, or an empty step)."""
        return cls(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
