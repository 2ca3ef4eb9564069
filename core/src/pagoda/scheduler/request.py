"""A request as the scheduler sees it."""

from __future__ import annotations

import copy
import enum
import time
from typing import TYPE_CHECKING, Any

from pagoda.kv_cache.hashing import BlockHash, extra_keys, hash_request_blocks
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.beam_search.group import BeamGroup
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.lora.request import LoRARequest
    from pagoda.multimodal.inputs import MultiModalFeature, MultiModalInputs
    from pagoda.spec_decode.proposer import Proposer
    from pagoda.structured_output.manager import RequestStructuredOutput


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def block_extra_keys(cache_salt: str | None, lora_request: LoRARequest | None = None) -> tuple[Any, ...] | None:
    """What a request mixes into its blocks' prefix-cache keys beside their tokens (salt, adapter)."""
    return extra_keys(cache_salt, lora_request)


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None,
                        lora_request: LoRARequest | None = None, mm: MultiModalInputs | None = None) -> list[BlockHash]:
    """The keys of a prompt's full blocks: the front end computes them once, off the engine loop (the data
    parallel balancer routes by them; the core's ``Request`` takes them as they are)."""
    return hash_request_blocks([], prompt_token_ids, block_size, block_extra_keys(cache_salt, lora_request),
                               mm.spans() if mm is not None else ())


class TypedParams:
    """Reads a request's ``params`` typed: ``sampling_params`` / ``pooling_params`` (vLLM's names) is the one
    it is, the other None."""

    __slots__ = ()
    params: SamplingParams | PoolingParams

    @property
    def sampling_params(self) -> SamplingParams | None:
        return self.params if isinstance(self.params, SamplingParams) else None

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.params if isinstance(self.params, PoolingParams) else None


class Request(TypedParams):
    """Token ids, progress and cache bookkeeping of one sequence.

    ``params`` is the request's ``SamplingParams``, or its ``PoolingParams`` for a pooling request
    (prefill only, finished by the pooler's output after its step); ``sampling_params`` and
    ``pooling_params`` read it typed (vLLM's names), the other one None.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_id: int | None,
        block_size: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        token_type_ids: list[int] | None = None,
        block_hashes: list[BlockHash] | None = None,
        lora_request: LoRARequest | None = None,
        mm: MultiModalInputs | None = None,
    ) -> None:
        params = sampling_params if pooling_params is None else pooling_params
        if not isinstance(params, (SamplingParams, PoolingParams)) or (sampling_params is not None
                                                                        and pooling_params is not None):
            raise TypeError(f"request {request_id!r} needs exactly one of SamplingParams and PoolingParams")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params: SamplingParams | PoolingParams = params
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # the prompt's token type ids (BERT-style pair encodings), one per prompt token
        self.token_type_ids = token_type_ids
        self.max_tokens: int | None = params.max_tokens if isinstance(params, SamplingParams) else None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule
        self.num_preemptions = 0
        # the adapter the request runs with (None: the base model); keys its blocks and its slot
        self.lora_request = lora_request
        self.extra_keys = block_extra_keys(cache_salt, lora_request)
        # multimodal items in prompt order (empty: text only); their hashes key the blocks they cover
        self.mm_features: list[MultiModalFeature] = list(mm.features) if mm is not None else []
        self._mm_spans = mm.spans() if mm is not None else []
        # the prompt's, when the front end hashed them already (an EngineCoreRequest's)
        self.block_hashes: list[BlockHash] = list(block_hashes or [])
        self._update_block_hashes()
        # prompt_logprobs: entries delivered so far, and entries waiting for the first token
        self.num_prompt_logprobs_sent = 0
        self.pending_prompt_logprobs: list[Any] = []
        # Beam search: the group this beam belongs to, and tokens the scheduler appended
        # that the runner has not been told about yet.
        self.beam_group: BeamGroup | None = None
        self.unsent_token_ids: list[int] = []
        # Structured outputs: the grammar future, then its matcher; None for an unconstrained request.
        self.structured_output: RequestStructuredOutput | None = None
        # Speculative decoding: drafts for the next step (vLLM's name), and the request's own proposer where
        # it has one (None: the engine's).
        self.spec_token_ids: list[int] = []
        self.spec_proposer: Proposer | None = None
        # timestamps for metrics
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, block_size: int) -> Request:
        """The scheduler's request for what a front end sent (the core hashes its blocks, not the front end)."""
        sampling = req.params if isinstance(req.params, SamplingParams) else None
        pooling = req.params if isinstance(req.params, PoolingParams) else None
        # the front end hashes with the block size the engine config resolved; a count that does not fit it
        # (a client of its own) is hashed again here
        hashes = req.block_hashes if len(req.block_hashes) == len(req.prompt_token_ids) // block_size else None
        request = cls(req.request_id, req.prompt_token_ids, sampling, req.eos_token_id, block_size,
                      arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
                      pooling_params=pooling, token_type_ids=req.token_type_ids, block_hashes=hashes,
                      lora_request=req.lora_request, mm=req.mm)
        if req.prediction_token_ids:
            from pagoda.spec_decode.prediction import PredictionProposer

            request.spec_proposer = PredictionProposer(req.prediction_token_ids)
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes prompt logprobs, so it must compute (not reuse cached) prompt positions."""
        params = self.params
        return (
            isinstance(params, SamplingParams) and params.prompt_logprobs is not None
            and self.num_prompt_logprobs_sent < self.num_prompt_tokens
        )

    def fork(self, child_id: str) -> Request:
        """A copy holding the same tokens and progress under a new id (the KV blocks are forked separately)."""
        # A shallow copy (no re-hashing of the prompt), then private copies of what grows.
        child = copy.copy(self)
        child.request_id = child_id
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.pending_prompt_logprobs = []
        child.unsent_token_ids = []
        child.spec_token_ids = []
        return child

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if len(self.block_hashes) < self.num_tokens // self.block_size:
            self.block_hashes = hash_request_blocks(
                self.block_hashes, self.all_token_ids, self.block_size, self.extra_keys, self._mm_spans
            )

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
