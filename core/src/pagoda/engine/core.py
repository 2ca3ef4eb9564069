"""The engine core loop: schedule -> execute -> update. No tokenization, no HTTP.

Front ends never hold an ``EngineCore``; they talk to it through an engine-core
client (``pagoda.engine.core_client``) and get back plain data: token outputs
and ``SchedulerStats``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from pagoda import envs
from pagoda.beam_search.group import BeamGroup
from pagoda.config import EngineConfig
from pagoda.engine.config_resolution import prepare_engine_config  # noqa: F401 - where callers have imported it from
from pagoda.engine.config_resolution import resolve_in_engine_core
from pagoda.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.executor import Executor
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError
from pagoda.lora.request import LoRARequest
from pagoda.metrics.stats import SchedulerStats
from pagoda.model_loader import load_tokenizer
from pagoda.platforms import Platform
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler
from pagoda.spec_decode import load_proposer_class
from pagoda.spec_decode.scheduling import SpecDecoding
from pagoda.structured_output.manager import StructuredOutputManager
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.process import replay_main_process_decisions

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        replay_main_process_decisions(config)
        # what the API process left to the process that runs the kernels (the CPU step budget)
        resolve_in_engine_core(config, platform)
        self.max_model_len = config.resolved.max_model_len
        sc = config.scheduler_config
        enable_caching = config.cache_config.enable_prefix_caching
        if config.resolved.runner_type == "pooling" and (sc.enable_chunked_prefill or enable_caching):
            # prepare_engine_config turned both off; a config built another way must not bring them back
            raise ValueError("a pooling model runs without chunked prefill and prefix caching")
        budget = config.max_num_batched_tokens  # decided by prepare_engine_config, or just above
        self.max_num_batched_tokens = budget
        # the workers (this process's, or one process per rank) load their model slices here
        self.model_executor = Executor.get_class(config)(config, platform)
        try:
            memory = self.model_executor.initialize_kv_cache(sc.max_num_seqs, budget)
            self._supported_tasks = self.model_executor.get_supported_tasks()
        except BaseException:
            self.model_executor.shutdown()
            raise
        self.block_size = memory.block_size
        self.memory = memory
        self.kv_cache_manager = KVCacheManager(
            memory.num_blocks, memory.block_size, enable_caching=enable_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            policy=sc.scheduling_policy,
            structured_output_manager=self._structured_output_manager(config),
            use_pp=config.parallel_config.pipeline_parallel_size > 1,
            max_loras=config.lora_config.max_loras if config.lora_config is not None else None,
            spec_decoding=self._spec_decoding(config),
            max_num_encoder_input_tokens=sc.max_num_encoder_input_tokens,
            encoder_cache_size=sc.encoder_cache_size,
        )
        # adapters the workers have read and checked: lora_int_id -> its request (vLLM's add_lora registry)
        self._loras: dict[int, LoRARequest] = {}
        self._reported_preemptions = 0
        self._sleep_level = 0
        # vLLM's batch queue: steps sent to the executor whose output is not applied yet, oldest first
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self.batch_queue_size = self.model_executor.max_concurrent_batches

    @property
    def batch_queue_size(self) -> int:
        """How many steps may be in flight at once: one per pipeline stage with the mp and ray executors
        (so no stage idles), else 1. Lowering it (benchmarks compare 1 and 2) waits for the queue to empty."""
        return self._batch_queue_size

    @batch_queue_size.setter
    def batch_queue_size(self, size: int) -> None:
        if not 1 <= size <= self.model_executor.max_concurrent_batches:
            raise ValueError(f"batch_queue_size must be 1..{self.model_executor.max_concurrent_batches} "
                             f"(the executor's max_concurrent_batches), got {size}")
        self._batch_queue_size = size
        self.scheduler.num_micro_batches = size

    def _spec_decoding(self, config: EngineConfig) -> SpecDecoding | None:
        """The proposer the speculative config names, from the plugins (None: speculation off)."""
        spec = config.speculative_config
        if spec is None:
            return None
        assert spec.method is not None  # inferred by the config
        proposer = load_proposer_class(spec.method)(spec)
        logger.info("speculative decoding: method %s, %d speculative tokens", spec.method, spec.k)
        return SpecDecoding(spec, proposer, self.max_model_len, log_interval_s=envs.PAGODA_LOG_STATS_INTERVAL)

    def _structured_output_manager(self, config: EngineConfig) -> StructuredOutputManager | None:
        """A generative model with a tokenizer gets one; the backend and tokenizer load on the first constraint."""
        model = config.model
        if config.resolved.runner_type != "generate" or model.skip_tokenizer_init:
            return None

        def tokenizer() -> Any:
            return load_tokenizer(config.resolved.source, model.tokenizer, model.tokenizer_revision,
                                  config.load_config.download_dir, model.trust_remote_code)

        vocab_size = int(config.resolved.text_config.vocab_size)
        so = config.structured_outputs_config
        return StructuredOutputManager(tokenizer, vocab_size, so.backend, so.reasoning_parser, so.enable_in_reasoning,
                                       grammar_cache_bytes=so.grammar_cache_bytes, compile_timeout=so.compile_timeout,
                                       compile_memory_bytes=so.compile_memory_bytes,
                                       compile_in_subprocess=so.compile_in_subprocess)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """What the loaded model serves: ("generate",), or its pooler's tasks (vLLM's supported tasks)."""
        return self._supported_tasks

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it runs in this process (the 'uni' executor); tests and tools read it."""
        from pagoda.executor.uniproc_executor import UniProcExecutor

        if not isinstance(self.model_executor, UniProcExecutor):
            raise RuntimeError(f"the model runs in worker processes (distributed_executor_backend="
                               f"{self.config.parallel_config.executor_backend!r}), not in the engine's process")
        return self.model_executor.driver_runner

    def check_health(self) -> None:
        """Raise if a worker died, hung or failed (pagoda.executor.ExecutorFailedError)."""
        self.model_executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (no-op for the in-process one); idempotent."""
        self.model_executor.shutdown()

    # -- requests ---------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora_request is not None:
            # a bad adapter fails its request here, before the scheduler holds it
            self.add_lora(request.lora_request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.block_size))

    # -- LoRA adapters (vLLM's EngineCore.add_lora / remove_lora / list_loras) ---------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Have every worker read and check the adapter; ``LoRAAdapterError`` naming it and the reason if
        it cannot be served (the engine keeps serving the rest)."""
        if self.config.lora_config is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was started without "
                             "enable_lora=True, so it serves no LoRA adapters")
        known = self._loras.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: lora_int_id={lora_request.lora_int_id} "
                                       f"is already adapter {known.lora_name!r} ({known.lora_path})")
            return True
        errors = [e for e in self.model_executor.collective_rpc("add_lora", (lora_request,)) if e]
        if errors:
            not_found, message = errors[0]
            raise (LoRAAdapterNotFoundError if not_found else LoRAAdapterError)(message)
        self._loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already running with it finish with it. False if it was not loaded."""
        if lora_int_id not in self._loras:
            return False
        if self.scheduler.uses_lora(lora_int_id):
            raise ValueError(f"LoRA adapter {self._loras[lora_int_id].lora_name!r} is in use by live requests; "
                             "unload it once they finish")
        del self._loras[lora_int_id]
        self.model_executor.collective_rpc("remove_lora", (lora_int_id,))
        return True

    def list_loras(self) -> set[int]:
        return set(self._loras)

    # -- sleep mode (vLLM's EngineCore.sleep / wake_up / is_sleeping) ---------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the weights too (level 2) while the engine idles.

        Refused while requests are in the engine: their KV cache would go with it."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.scheduler.has_unfinished_requests() or self.batch_queue:
            raise ValueError("the engine has requests in flight; sleep once they finish")
        while self.scheduler.has_finished_ids_pending():
            self.step()  # an empty step: the runner forgets the finished requests before its batch goes
        if self._sleep_level:
            raise ValueError(f"the engine is asleep already (level {self._sleep_level})")
        self.model_executor.collective_rpc("sleep", (level,))
        # the cached prefixes' blocks are gone with the cache
        self.kv_cache_manager.reset_prefix_cache()
        self._sleep_level = level
        logger.info("engine asleep (level %d: %s freed)", level, "KV cache" if level == 1 else "KV cache and weights")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Rebuild what ``sleep`` freed (vLLM's ``tags`` pick weights or kv_cache; pagoda restores both at
        once, so a tag other than those two is refused). A no-op when awake."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(unknown)}")
        if not self._sleep_level:
            return
        self.model_executor.collective_rpc("wake_up")
        level, self._sleep_level = self._sleep_level, 0
        if level == 2:
            # the reloaded model has no adapters yet: give it back the ones the engine had
            for lora in self._loras.values():
                self.model_executor.collective_rpc("add_lora", (lora,))
        logger.info("engine awake (from level %d)", level)

    def is_sleeping(self) -> bool:
        return bool(self._sleep_level)

    def set_cpu_share(self, cpus: list[int]) -> list[dict[str, Any]]:
        """Run this engine's ranks on ``cpus`` from the next step on (a many-model server rebalancing the
        machine between its engines); what each rank applied (``pagoda.worker.cpu_share.CpuShare``)."""
        if not cpus or not all(isinstance(c, int) and c >= 0 for c in cpus):
            raise ValueError(f"cpus must be a non-empty list of CPU numbers, got {cpus!r}")
        shares = self.model_executor.collective_rpc("set_cpu_share", (list(cpus),))
        logger.info("CPU share: %s", "; ".join(f"{s['threads']} torch threads on CPUs {s['cpus']}"
                                                + (f" (kept: {s['kept']})" if s["kept"] else "") for s in shares))
        return shares

    def get_memory_usage(self) -> dict[str, int]:
        """The weights' and the KV cache's bytes (one rank's, as sized at start): what a parked engine keeps
        at each sleep level (level 1 the weights, level 2 neither)."""
        return {"weights_bytes": self.memory.weights_bytes, "kv_cache_bytes": self.memory.kv_cache_bytes}

    def get_memory_bytes(self) -> int:
        """What this engine holds for its model: the weights plus the KV cache (one rank's), as sized at start."""
        return self.memory.weights_bytes + self.memory.kv_cache_bytes

    def add_beam_search(self, group: BeamGroup, root: EngineCoreRequest) -> None:
        if root.lora_request is not None:
            self.add_lora(root.lora_request)
        self.scheduler.add_beam_search(group, Request.from_engine_core_request(root, self.block_size))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests and beam searches by id; unknown ids are ignored (already finished)."""
        self.scheduler.abort_requests(request_ids)

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self._batch_queue_size > 1 or self.batch_queue:
            return self.step_with_batch_queue()
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.finished_req_ids:
                # let the runner forget finished requests even in an idle step
                self.model_executor.execute_model(so)
            return self.scheduler.take_pending_outputs()
        out = self.model_executor.execute_model(so)
        return self.scheduler.update_from_output(so, out)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """vLLM's pipelined step: keep up to ``batch_queue_size`` steps in flight, apply outputs in order.

        Schedule a batch from the requests no batch in flight holds and send it without waiting; block
        on the oldest batch only when the queue is full, nothing more could be scheduled, or the oldest
        is done already. Returns the outputs of the batch it applied ([] when it applied none).
        """
        queue = self.batch_queue
        if len(queue) < self._batch_queue_size:
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids:
                # (an empty batch still tells the runner which requests to forget)
                queue.append((self.model_executor.execute_model(so, non_block=True), so))
                if not so.is_empty and len(queue) < self._batch_queue_size and not queue[0][0].done():
                    return self.scheduler.take_pending_outputs()
        if not queue:
            return self.scheduler.take_pending_outputs()
        future, so = queue.popleft()
        try:
            out = future.result()
        except BaseException:
            self.scheduler.discard_batch(so)
            raise
        return self.scheduler.update_from_output(so, out)

    def fail_running(self) -> list[str]:
        """After a step raised: finish every running request, and every one a batch in flight holds, with
        an error; returns their ids. The batches in flight are dropped (their outputs would be stale)."""
        in_flight = self.scheduler.in_flight_request_ids()
        for _, so in self.batch_queue:
            self.scheduler.discard_batch(so)
        self.batch_queue.clear()
        victims = list(dict.fromkeys([r.request_id for r in self.scheduler.running] + in_flight))
        self.scheduler.finish_requests(victims, RequestStatus.FINISHED_ERROR)
        return victims

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run, batches in flight, or finished requests the runner has still to forget."""
        return (self.scheduler.has_unfinished_requests() or bool(self.batch_queue)
                or self.scheduler.has_finished_ids_pending())

    def make_stats(self) -> SchedulerStats:
        """The scheduler's gauges now; preemptions counted since the previous call."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        preemptions = self.scheduler.num_preemptions
        stats = SchedulerStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=preemptions - self._reported_preemptions,
            spec_decoding_stats=self.scheduler.spec.take_stats() if self.scheduler.spec is not None else None,
        )
        if self.config.lora_config is not None:
            stats.max_lora = self.config.lora_config.max_loras
            stats.running_lora_adapters, stats.waiting_lora_adapters = self.scheduler.lora_adapter_counts()
        self._reported_preemptions = preemptions
        return stats
