"""LLMEngine: the synchronous engine (add_request / step / abort_request)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from pagoda.beam_search.frontend import BeamSearchFrontend
from pagoda.beam_search.group import EarlyStopping
from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.logits_processors import resolve_logits_processors
from pagoda.engine.output_processor import OutputProcessor, ParentState, RequestState
from pagoda.model_loader import load_tokenizer
from pagoda.models.registry import ModelRegistry
from pagoda.outputs import RequestOutput
from pagoda.platforms import resolve_platform, set_current_platform
from pagoda.plugins import get_plugin_manager
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.scheduler.request import Request

logger = logging.getLogger(__name__)


def prepare_engine_config(config: EngineConfig) -> Any:
    """Decide once in the main process: plugins, in-script models, platform."""
    pm = get_plugin_manager()
    config.plugins = pm.loaded_names()
    config.registered_models = ModelRegistry.registered_in_script()
    platform = resolve_platform(config.device_config.device)
    set_current_platform(platform)
    platform.check_and_update_config(config)
    pm.startup(config)
    return platform


def eos_and_stop_ids(tokenizer: Any, hf_config: Any) -> tuple[int | None, list[int]]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    cfg_eos = getattr(hf_config, "eos_token_id", None)
    extra = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
    if eos is None and extra:
        eos = extra[0]
    return eos, [t for t in extra if t != eos]


class CoreClient(Protocol):
    """Where the frontend's request traffic goes: the in-process ``EngineCore`` itself,
    or a client that forwards to a core running elsewhere (AsyncLLM's core thread)."""

    def add_request(self, request: Request) -> None: ...

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = prepare_engine_config(config)
        self.core = EngineCore(config, self.platform)
        self.core_client: CoreClient = self.core
        runner = self.core.runner
        self.hf_config = runner.hf_config
        self.model_config = config.model
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(runner.source, config.model.tokenizer)
        self.max_model_len = runner.max_model_len
        vocab = int(getattr(runner.text_config, "vocab_size", 0)) or (len(self.tokenizer) if self.tokenizer else 0)
        self.vocab_size = vocab
        self.eos_token_id, self.extra_stop_ids = eos_and_stop_ids(self.tokenizer, self.hf_config)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, vocab)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_searches = BeamSearchFrontend(self.tokenizer, self.max_model_len, self.core.block_size)

    def attach_core_client(self, client: CoreClient) -> None:
        """Send add/abort to ``client`` instead of stepping the core in this thread.

        The caller then owns the core loop (``self.core.step()``) and feeds its
        outputs to ``self.output_processor``; ``step()`` must not be called.
        """
        self.core_client = client

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests ---------------------------------------------------------------
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

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        **_: Any,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'")
        if params.logprobs is not None and params.logprobs > self.model_config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.model_config.max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.model_config.max_logprobs:
            raise ValueError(
                f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={self.model_config.max_logprobs}"
            )
        text, ids, salt = self.input_processor.process(prompt, params)
        arrival = time.time() if arrival_time is None else arrival_time
        n_children = max(params.best_of or params.n, params.n)
        rank = n_children > params.n
        children: list[RequestState] = []
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
            children.append(RequestState(child_id, request_id, i, text, ids, p, detok,
                                         wants_logprobs=params.logprobs is not None))
            self.core_client.add_request(
                Request(child_id, ids, p, None if p.ignore_eos else self.eos_token_id, self.core.block_size,
                        arrival_time=arrival, priority=priority, cache_salt=salt)
            )
        self.output_processor.add_request(
            ParentState(request_id, params.n, n_children, children, params.output_kind, rank_by_logprob=rank)
        )

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: Any,
        params: BeamSearchParams,
        arrival_time: float | None = None,
        early_stopping: EarlyStopping = False,
    ) -> None:
        """Beam search inside the scheduler: its beams fork, share KV blocks and step with everything else.

        Finishes with one RequestOutput whose outputs are the best beams, best first.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.output_processor.has(request_id) or request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, salt = self.input_processor.process(prompt, None)
        group, root = self.beam_searches.start(request_id, text, ids, salt, params, self.eos_token_id,
                                               early_stopping, arrival_time)
        self.core.scheduler.add_beam_search(group, root)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.beam_searches.forget(rid):
                self.core.abort_requests([rid])
                continue
            self.core_client.abort_requests(self.output_processor.abort(rid))

    def step(self) -> list[RequestOutput]:
        if self.core_client is not self.core:
            raise RuntimeError("this engine's core is driven by an attached client (AsyncLLM); step() is not available")
        outputs = self.core.step()
        outputs, beam_results = self.beam_searches.split(outputs)
        results, to_abort = self.output_processor.process(outputs)
        results.extend(beam_results)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents) + len(self.beam_searches)

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)
