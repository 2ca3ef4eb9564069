"""Every message that crosses between a front end and the engine core (vLLM v1's ``vllm.v1.engine`` types).

In: ``EngineCoreRequest`` (one sequence to run; the core builds its scheduler ``Request`` from it).
Out: ``EngineCoreOutputs`` after every step, one ``EngineCoreOutput`` per request that moved.

These are the only types the engine-core process receives and sends (pickled, ``pagoda.engine.core_proc``),
so they stay small, typed and free of scheduler state. They are ``msgspec.Struct``s, as vLLM's are: a Struct
pickles in C, where a dataclass with slots pickles through Python-level ``__getstate__`` (32 decode outputs:
dumps 66-76 us against 128-226 us, loads 44 us against 150-165 us, half the bytes; benchmarks/wire_cost.py).
``gc=False``: they hold no reference cycles, so the collector need not track the thousands made per second. A per-request feature adds one optional sub-record
here (and its reader in the core), never a field in every layer. The scheduler <-> model runner messages
live in ``pagoda.scheduler.output``: that is the other boundary, inside the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

    from pagoda.logprobs import Logprob
    from pagoda.lora.request import LoRARequest
    from pagoda.metrics.stats import SchedulerStats
    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.pooling_params import PoolingParams
    from pagoda.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, gc=False):
    """One sequence for the core: a prompt's token ids and how to continue (or pool) it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    # None: the sequence does not stop at EOS (ignore_eos, or a pooling request)
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # mixed into the prefix cache's block keys: requests with different salts never share KV
    cache_salt: str | None = None
    # the prompt's token type ids (BERT-style pair encodings), one per prompt token
    token_type_ids: list[int] | None = None
    # the prefix-cache keys of the prompt's full blocks (pagoda.scheduler.request.prompt_block_hashes), hashed
    # by the front end; empty: the core hashes them
    block_hashes: list[bytes] = msgspec.field(default_factory=list)
    # the adapter to run with (multi-LoRA); None: the base model
    lora_request: LoRARequest | None = None
    # predicted outputs (OpenAI's prediction): the expected output's token ids, drafted by a per-request
    # proposer (pagoda.spec_decode.prediction)
    prediction_token_ids: list[int] | None = None
    # multimodal inputs (images): each item's content hash, placeholder range and processed tensors; None: text only
    mm: MultiModalInputs | None = None


class PredictionCounts(msgspec.Struct, gc=False):
    """A prediction request's counts so far (OpenAI's usage.completion_tokens_details names)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class EngineCoreOutput(msgspec.Struct, gc=False):
    """What the core reports for one request after a step."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # logprobs=N: one {token_id: Logprob} per new token, and each new token's own logprob
    new_logprobs: list[dict[int, Logprob]] | None = None
    new_sampled_logprobs: list[float] | None = None
    # prompt_logprobs=N: the entries not delivered yet (prompt token 0's is None)
    new_prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    # A finished beam search group: its best sequences, best first (pagoda.beam_search.group.BeamSequence).
    beam_sequences: list[Any] | None = None
    # Set on a request's first output only: when it was first scheduled (for queue-time metrics).
    first_scheduled_time: float | None = None
    # A finished pooling request: the pooler's tensor for it (float32, host).
    pooling_output: torch.Tensor | None = None
    # A request with a prediction: its counts so far (on every output, so a front end that finishes the
    # request on a stop string still has them)
    prediction: PredictionCounts | None = None


class EngineCoreOutputs(msgspec.Struct, gc=False):
    """What one step of the core sends back to its front end."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # requests the step took down with it (it raised): request id -> the exception
    failed: dict[str, BaseException] = msgspec.field(default_factory=dict)
    scheduler_stats: SchedulerStats | None = None
