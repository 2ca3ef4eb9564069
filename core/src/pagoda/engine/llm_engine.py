"""LLMEngine: the synchronous engine (add_request / step / abort_request).

Built from the same parts as ``AsyncLLM``: a ``Processor`` (prompts ->
core requests), an engine-core client (here in-process: each ``step()`` is one
core step) and an ``OutputProcessor`` (token outputs -> RequestOutputs).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pagoda.beam_search.group import EarlyStopping
from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.config_resolution import prepare_engine_config
from pagoda.engine.core_client import InprocClient
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.processor import Processor
from pagoda.lora.request import LoRARequest
from pagoda.metrics.stats import SchedulerStats
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import BeamSearchParams, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs engine-core replicas behind AsyncLLM (pagoda serve); "
                             "LLM / LLMEngine run one engine core")
        platform = prepare_engine_config(config)
        self.processor = Processor(config)
        self.tokenizer = self.processor.tokenizer
        self.max_model_len = self.processor.max_model_len
        self.vocab_size = self.processor.vocab_size
        # a copy with the context length decided, as vLLM's engines expose it (lm-eval reads
        # model_config.max_model_len); the config itself keeps what the user gave
        self.model_config = config.model.model_copy(update={"max_model_len": self.max_model_len})
        self.engine_core = InprocClient(config, platform)
        # what the loaded model serves: ("generate",) or its pooling tasks (vLLM's supported tasks)
        self.supported_tasks: tuple[str, ...] = self.engine_core.get_supported_tasks()
        self.processor.supported_tasks = self.supported_tasks
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_searches = self.processor.beam_searches

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request: ``SamplingParams`` generate, ``PoolingParams`` pool (one ``PoolingRequestOutput``);
        ``lora_request``: the adapter it runs with (enable_lora)."""
        params = params or SamplingParams()
        self._check_awake()
        if self.output_processor.has(request_id) or request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        parent, requests = self.processor.process(request_id, prompt, params, arrival, priority, lora_request)
        for request in requests:
            self.engine_core.add_request(request)
        self.output_processor.add_request(parent)

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: Any,
        params: BeamSearchParams,
        arrival_time: float | None = None,
        early_stopping: EarlyStopping = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Beam search in the engine core: its beams fork, share KV blocks and step with everything else.

        Finishes with one RequestOutput whose outputs are the best beams, best first.
        """
        self._check_awake()
        if self.output_processor.has(request_id) or request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        group, root = self.processor.process_beam_search(request_id, prompt, params, arrival_time, early_stopping,
                                                         lora_request)
        self.engine_core.add_beam_search(group, root)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.beam_searches.forget(rid):
                self.engine_core.abort_requests([rid])
                continue
            self.engine_core.abort_requests(self.output_processor.abort(rid))

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        outputs, beam_results = self.beam_searches.split(self.engine_core.get_output().outputs)
        results, to_abort = self.output_processor.process(outputs)
        results.extend(beam_results)
        self.engine_core.abort_requests(to_abort)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents) + len(self.beam_searches)

    # -- LoRA adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) ----------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter ahead of its first request (LoRAAdapterError if it cannot be served)."""
        lora = self.processor.check_lora(lora_request)
        assert lora is not None
        return self.engine_core.add_lora(lora)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    # -- sleep mode (vLLM's LLMEngine.sleep / wake_up / is_sleeping) -----------------------------------
    def sleep(self, level: int = 1) -> None:
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def _check_awake(self) -> None:
        if self.engine_core.is_sleeping():
            raise ValueError("the engine is asleep: call wake_up() before generating")

    def get_stats(self) -> SchedulerStats:
        """The core's gauges (running, waiting, KV usage, prefix cache) as data."""
        return self.engine_core.get_stats()
