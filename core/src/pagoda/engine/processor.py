"""The front ends' request side: a user request becomes scheduler requests for the core.

Shared by ``LLMEngine`` and ``AsyncLLM``: validate (errors never reach the
core), tokenize, expand ``n`` / ``best_of`` into one sequence each with its own
parameters, and build the output processor's state for them. A beam search
becomes one group and its root beam.
"""

from __future__ import annotations

from typing import Any

from pagoda.beam_search.frontend import BeamSearchFrontend
from pagoda.beam_search.group import BeamGroup, EarlyStopping
from pagoda.config import EngineConfig
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.logits_processors import resolve_logits_processors
from pagoda.engine.output_processor import ParentState, RequestState
from pagoda.model_loader import load_tokenizer
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.scheduler.request import Request


def eos_and_stop_ids(tokenizer: Any, hf_config: Any, generation: Any = None) -> tuple[int | None, list[int]]:
    """-> (the EOS the engine stops on, the other end tokens: config.json's and generation_config.json's)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    cfg_eos = getattr(hf_config, "eos_token_id", None)
    extra = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
    # generation_config.json lists every end token (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>), as vLLM reads it
    extra += [t for t in (generation.eos_token_ids if generation is not None else ()) if t not in extra]
    if eos is None and extra:
        eos = extra[0]
    return eos, [t for t in extra if t != eos]


class Processor:
    """Turns prompts and parameters into the core's requests; owns the tokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        model = config.resolved
        self.config = config
        self.model_config = config.model
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(
            model.source, config.model.tokenizer, config.model.tokenizer_revision, config.load_config.download_dir,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size or (len(self.tokenizer) if self.tokenizer is not None else 0)
        self.block_size: int = config.cache_config.block_size  # type: ignore[assignment]  # resolved with the config
        self.eos_token_id, self.extra_stop_ids = eos_and_stop_ids(self.tokenizer, model.hf_config, model.generation)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)
        self.beam_searches = BeamSearchFrontend(self.tokenizer, self.max_model_len, self.block_size)

    def _child_params(self, params: SamplingParams, prompt_len: int, rank_by_logprob: bool) -> SamplingParams:
        p = params.clone()
        # names become processors here, one instance per sequence (processors may keep state)
        p.logits_processors = resolve_logits_processors(p.logits_processors)
        if p.max_tokens is None:
            p.max_tokens = self.max_model_len - prompt_len
        # EOS and the config's extra EOS ids: stop tokens that min_tokens masks
        p.update_from_generation_config({"eos_token_id": self.extra_stop_ids}, model_eos_token_id=self.eos_token_id)
        if p.bad_words and self.tokenizer is not None:
            p.update_from_tokenizer(self.tokenizer, self.vocab_size)
        if rank_by_logprob and p.logprobs is None:
            # best_of ranks by cumulative logprob, so the sampler must report it
            p.logprobs = 0
        return p

    def _check(self, params: SamplingParams, priority: int) -> None:
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'")
        max_logprobs = self.model_config.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={max_logprobs}")

    def process(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float, priority: int
    ) -> tuple[ParentState, list[Request]]:
        """-> (the output processor's state for the request, one core request per sequence)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check(params, priority)
        text, ids, salt = self.input_processor.process(prompt, params)
        n_children = max(params.best_of or params.n, params.n)
        rank = n_children > params.n
        states: list[RequestState] = []
        requests: list[Request] = []
        for i in range(n_children):
            child_id = request_id if n_children == 1 else f"{i}_{request_id}"
            p = self._child_params(params, len(ids), rank)
            if n_children > 1 and p.seed is not None:
                p.seed = p.seed + i
            if i > 0:
                # the prompt's logprobs are the same for every sequence: computed once
                p.prompt_logprobs = None
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.spaces_between_special_tokens)
            states.append(RequestState(child_id, request_id, i, text, ids, p, detok,
                                       wants_logprobs=params.logprobs is not None))
            requests.append(Request(child_id, ids, p, None if p.ignore_eos else self.eos_token_id, self.block_size,
                                    arrival_time=arrival_time, priority=priority, cache_salt=salt))
        parent = ParentState(request_id, params.n, n_children, states, params.output_kind, rank_by_logprob=rank)
        return parent, requests

    def process_beam_search(
        self, request_id: str, prompt: Any, params: BeamSearchParams, arrival_time: float | None,
        early_stopping: EarlyStopping,
    ) -> tuple[BeamGroup, Request]:
        """-> (the group, its root beam); ``beam_searches`` tracks it until the core reports it done."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        text, ids, salt = self.input_processor.process(prompt, None)
        return self.beam_searches.start(request_id, text, ids, salt, params, self.eos_token_id,
                                        early_stopping, arrival_time)
