"""AsyncLLM: the engine for servers; async generators of RequestOutputs.

A sibling of ``LLMEngine`` built from the same parts: a ``Processor``
(prompts -> core requests), an engine-core client and an ``OutputProcessor``.
Its client (``ThreadedClient``) runs the core (schedule -> execute -> update)
alone in a background thread, or (``MPClient``, PAGODA_ENABLE_V1_MULTIPROCESSING,
and one per replica with data_parallel_size > 1) in its own process, whose
receiver thread plays the core thread's part below. Everything around it runs on the asyncio loop:
tokenizing and validating prompts, detokenizing, stop strings, per-request
collectors, metrics. The two sides meet in two places only:

* the client's command queue the core thread drains between steps (new requests, aborts);
* ``loop.call_soon_threadsafe`` that hands each step's ``EngineCoreOutputs`` back.

So a step never waits on HTTP, JSON or the tokenizer, and the event loop never
waits on a step (torch releases the GIL inside its kernels). When the core runs
in a thread and when in its own process, and the measurements behind it:
docs/benchmarks.md, "The engine core in its own process: the decision".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.config_resolution import prepare_engine_config
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.engine.mp_client import make_async_client
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.processor import Processor
from pagoda.lora.request import LoRARequest
from pagoda.metrics.requests import RequestMetrics
from pagoda.metrics.stats import IterationStats, SchedulerStats, StatLogger
from pagoda.engine.errors import EngineDeadError, EngineGenerateError, EngineSleepingError
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a newer DELTA output into an undelivered one, so a slow reader keeps one object."""
    by_index = {o.index: o for o in into.outputs}
    for out in new.outputs:
        old = by_index.get(out.index)
        if old is None:
            into.outputs.append(out)
            continue
        old.text += out.text
        old.token_ids = list(old.token_ids) + list(out.token_ids)
        if out.logprobs is not None:
            old.logprobs = list(old.logprobs or []) + list(out.logprobs)
        old.cumulative_logprob = out.cumulative_logprob
        old.finish_reason = out.finish_reason
        old.stop_reason = out.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class RequestOutputCollector:
    """Holds at most one pending output per request: DELTAs merge, others replace."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        # a pooling request's output is a PoolingRequestOutput (FINAL_ONLY: replaced, never merged)
        self.output: RequestOutput | PoolingRequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | PoolingRequestOutput | Exception) -> None:
        if isinstance(item, Exception) or self.output is None or isinstance(self.output, Exception):
            if not isinstance(self.output, Exception):
                self.output = item
        elif self.kind == RequestOutputKind.DELTA and isinstance(self.output, RequestOutput) \
                and isinstance(item, RequestOutput):
            _merge_delta(self.output, item)
        else:
            self.output = item
        self.ready.set()

    async def get(self) -> Any:
        await self.ready.wait()
        item = self.output
        self.output = None
        self.ready.clear()
        if isinstance(item, Exception):
            raise item
        assert item is not None
        return item


class RequestStream:
    """The outputs of one request; leaving the iteration early (client gone) aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: RequestOutputCollector) -> None:
        self.engine = engine
        self.request_id = request_id
        self.collector = collector
        self.finished = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while not self.finished:
                out = await self.collector.get()
                self.finished = out.finished
                yield out
        finally:
            # client gone (CancelledError / GeneratorExit) or an engine error: free the core's blocks
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._abort_local(self.request_id)
        self.engine._forget(self.request_id)


@dataclass
class _Tracked:
    """Front-end bookkeeping of one user request: where its outputs go, and its metrics."""

    collector: RequestOutputCollector
    metrics: RequestMetrics
    pooling: bool = False


class AsyncLLM:
    """vLLM's AsyncLLM: ``async for out in engine.generate(prompt, params, request_id)``."""

    def __init__(self, config: EngineConfig, log_stats: bool = True, engine_core_process: bool = False) -> None:
        """``engine_core_process``: run a single-rank engine's core in its own process when
        PAGODA_ENABLE_V1_MULTIPROCESSING is unset (False: a thread of this process; `pagoda serve` passes True)."""
        self.config = config
        platform = prepare_engine_config(config)
        # a thread of this process, or its own process(es): pagoda.engine.mp_client.make_async_client.
        # A core process has its config from here on and loads the model while this process loads the
        # tokenizer; it is waited for below.
        self.engine_core = make_async_client(config, platform, self._from_core_thread, self._core_died,
                                             engine_core_process, wait_ready=False)
        try:
            self.processor = Processor(config)
            self.engine_core.wait_ready()
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.tokenizer = self.processor.tokenizer
        self.max_model_len = self.processor.max_model_len
        self.vocab_size = self.processor.vocab_size
        # a copy with the context length decided, as vLLM's engines expose it (lm-eval reads
        # model_config.max_model_len); the config itself keeps what the user gave
        self.model_config = config.model.model_copy(update={"max_model_len": self.max_model_len})
        self.output_processor = OutputProcessor(self.tokenizer)
        # what the loaded model serves: ("generate",) or its pooling tasks (vLLM's supported tasks)
        self.supported_tasks: tuple[str, ...] = self.engine_core.get_supported_tasks()
        # adapters the core has loaded (add_lora): a request naming one goes straight in
        self._loras: set[int] = set()
        self.processor.supported_tasks = self.supported_tasks
        self._tracked: dict[str, _Tracked] = {}
        self._sleeping = False
        # log_stats=False: stat loggers get no records
        self.stat_loggers: list[StatLogger] = []
        self.log_stats = log_stats
        self._loop: asyncio.AbstractEventLoop | None = None
        # A request's preparation (tokenizing, bad words, checks, block hashes) runs here, off the event
        # loop. One thread: the Rust tokenizer refuses a second thread's call that changes its truncation
        # while another encodes ("Already borrowed"), and one queue keeps the work in arrival order.
        self.prep_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-prep")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, log_stats: bool = True,
                         engine_core_process: bool = False) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), log_stats=log_stats, engine_core_process=engine_core_process)

    # -- public API ---------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_tokenizer_async(self) -> Any:
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self.engine_core.is_alive and self.engine_core.dead_error is None

    @property
    def errored(self) -> bool:
        return self.engine_core.dead_error is not None

    async def check_health(self) -> None:
        if self.engine_core.dead_error is not None:
            error = EngineDeadError(f"the engine core died: {self.engine_core.dead_error!r}")
        elif self.engine_core.stopped_unexpectedly:
            error = EngineDeadError("the engine core stopped unexpectedly")
        else:
            return
        if self._tracked:
            # requests queued to a core that is gone would wait for ever: fail them now (a no-op when the
            # client's own death callback got there first)
            self._fail_all(error)
        raise error

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate, tokenize and queue a request; bad input raises ValueError here, before the core sees it.

        ``PoolingParams`` make a pooling request (prefill only, one ``PoolingRequestOutput``).

        The caller must iterate the returned stream to its end or call ``abort()`` on it. A
        ``lora_request`` must have been added first (``add_lora``; ``generate`` / ``encode`` do it).
        """
        self._check_admissible(request_id, lora_request)
        prepared = self.processor.process(request_id, prompt, sampling_params, time.time(), priority, lora_request)
        return self._queue(request_id, prepared, sampling_params)

    async def add_request_async(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """``add_request`` with the preparation on ``prep_executor``: the event loop (and every other
        request's stream) never waits on a long prompt's tokenization or a long ``bad_words`` list."""
        self._check_admissible(request_id, lora_request)
        arrival = time.time()
        prepared = await self.run_prep(self.processor.process, request_id, prompt, sampling_params, arrival,
                                       priority, lora_request)
        self._check_alive()
        self._check_unused(request_id)
        return self._queue(request_id, prepared, sampling_params)

    async def run_prep(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the preparation thread (tokenizer work, in the order it was asked for)."""
        return await asyncio.get_running_loop().run_in_executor(self.prep_executor, fn, *args)

    def _check_admissible(self, request_id: str, lora_request: LoRARequest | None) -> None:
        """What a request must pass before it is prepared: a live engine, a fresh id, a loaded adapter."""
        self._check_alive()
        self._ensure_started()
        self._check_unused(request_id)
        self._check_lora_loaded(lora_request)

    def _check_alive(self) -> None:
        if self.engine_core.dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self.engine_core.dead_error!r}")
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep: wake_up() it first")

    def _check_unused(self, request_id: str) -> None:
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def _check_lora_loaded(self, lora_request: LoRARequest | None) -> None:
        if lora_request is not None and lora_request.lora_int_id not in self._loras:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded: await add_lora first")

    def _queue(self, request_id: str, prepared: tuple[Any, list[Any]],
               sampling_params: SamplingParams | PoolingParams) -> RequestStream:
        parent, requests = prepared
        for request in requests:
            self.engine_core.add_request(request)
        self.output_processor.add_request(parent)
        collector = RequestOutputCollector(sampling_params.output_kind)
        metrics = RequestMetrics(requests[0].arrival_time, len(requests[0].prompt_token_ids),
                                 num_sequences=len(requests))
        self._tracked[request_id] = _Tracked(collector, metrics, isinstance(sampling_params, PoolingParams))
        return RequestStream(self, request_id, collector)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (vLLM's signature)."""
        if lora_request is not None:
            await self.add_lora(lora_request)
        stream = self.add_request(request_id, prompt, sampling_params, priority, lora_request)
        async for out in stream:
            yield out

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's output (vLLM's signature): one final ``PoolingRequestOutput``.

        ``pooling_params.task`` picks the pooler ("embed", "classify", "score", "token_embed",
        "token_classify"; None = the model's first, "encode" = its per-token task). Bad input or
        parameters the model refuses (``dimensions`` on a model without matryoshka support, a task it
        does not serve) raise ValueError before the core sees the request.
        """
        if trace_headers is not None:
            raise ValueError("trace_headers (OpenTelemetry tracing) are not supported by pagoda yet")
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}")
        if truncate_prompt_tokens is not None or tokenization_kwargs:
            pooling_params = pooling_params.clone()
            limit = truncate_prompt_tokens
            if tokenization_kwargs:
                unknown = set(tokenization_kwargs) - {"truncation", "max_length"}
                if unknown:
                    raise ValueError(f"tokenization_kwargs {sorted(unknown)} are not supported (only truncation, max_length)")
                if tokenization_kwargs.get("truncation") and limit is None:
                    limit = tokenization_kwargs.get("max_length", -1)
            if limit is not None:
                pooling_params.truncate_prompt_tokens = limit
                pooling_params.__post_init__()
        if lora_request is not None:
            await self.add_lora(lora_request)
        stream = await self.add_request_async(request_id, prompt, pooling_params, priority, lora_request)
        async for out in stream:
            yield out

    # -- LoRA adapters (vLLM's AsyncLLM.add_lora / remove_lora / list_loras) -----------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter in the core (its workers read it); LoRAAdapterError naming it and the
        reason when it cannot be served. Already loaded: nothing to do."""
        if lora_request.lora_int_id in self._loras:
            return True
        self.processor.check_lora(lora_request)
        self._ensure_started()
        result = await asyncio.wrap_future(self.engine_core.call_utility("add_lora", lora_request))
        self._loras.add(lora_request.lora_int_id)
        return bool(result)

    async def remove_lora(self, lora_id: int) -> bool:
        self._ensure_started()
        removed = await asyncio.wrap_future(self.engine_core.call_utility("remove_lora", lora_id))
        self._loras.discard(lora_id)
        return bool(removed)

    async def list_loras(self) -> set[int]:
        self._ensure_started()
        return set(await asyncio.wrap_future(self.engine_core.call_utility("list_loras")))

    # -- sleep mode (vLLM's AsyncLLM.sleep / wake_up / is_sleeping; needs enable_sleep_mode) -------------
    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the weights too (level 2); requests are refused until ``wake_up``.
        ValueError while requests are in flight, or without enable_sleep_mode."""
        if self._tracked:
            raise ValueError(f"the engine has {len(self._tracked)} request(s) in flight; sleep once they finish")
        self._ensure_started()
        # refused from here on: a request queued behind the sleep call would find no KV cache
        self._sleeping = True
        try:
            await asyncio.wrap_future(self.engine_core.call_utility("sleep", level))
        except BaseException:
            self._sleeping = False
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._ensure_started()
        await asyncio.wrap_future(self.engine_core.call_utility("wake_up", tags))
        self._sleeping = False

    async def is_sleeping(self) -> bool:
        return self._sleeping

    async def get_memory_bytes(self) -> int:
        """The engine's weights plus KV cache in bytes (what a model pool's memory budget counts)."""
        self._ensure_started()
        return int(await asyncio.wrap_future(self.engine_core.call_utility("get_memory_bytes")))

    async def get_memory_usage(self) -> dict[str, int]:
        """``weights_bytes`` and ``kv_cache_bytes`` (``EngineCore.get_memory_usage``)."""
        self._ensure_started()
        return dict(await asyncio.wrap_future(self.engine_core.call_utility("get_memory_usage")))

    async def set_cpu_share(self, cpus: list[int]) -> list[dict[str, Any]]:
        """Confine the engine core to ``cpus`` between steps (``EngineCore.set_cpu_share``); what it applied."""
        self._ensure_started()
        return list(await asyncio.wrap_future(self.engine_core.call_utility("set_cpu_share", list(cpus))))

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; their streams end with a finished output (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            tracked = self._tracked.get(rid)
            self._abort_local(rid)
            if tracked is not None:
                ended: RequestOutput | PoolingRequestOutput
                if tracked.pooling:
                    ended = PoolingRequestOutput(rid, None, [], 0, True)
                else:
                    ended = RequestOutput(rid, None, [], None, [], finished=True)
                tracked.collector.put(ended)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.prep_executor.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown(timeout)

    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # -- front-end internals (event loop thread) -----------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed() and self._tracked:
                raise RuntimeError("AsyncLLM is serving requests on another event loop")
            self._loop = loop  # a new loop (e.g. a second asyncio.run) takes over delivery
        self.engine_core.start()

    def _abort_local(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        self.engine_core.abort_requests(self.output_processor.abort(request_id))
        if tracked is not None:
            self._record_finished(tracked, "abort")

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def _owner_of(self, child_id: str) -> str | None:
        state = self.output_processor.children.get(child_id)
        return state.parent_id if state is not None else None

    def _on_step(self, batch: EngineCoreOutputs) -> None:
        """Runs on the event loop: detokenize, stop strings, deliver, metrics."""
        now = time.time()
        iteration = IterationStats()
        for child_id, exc in batch.failed.items():
            parent_id = self._owner_of(child_id)
            if parent_id is None:
                continue
            tracked = self._tracked.get(parent_id)
            self.engine_core.abort_requests(self.output_processor.abort(parent_id))
            if tracked is not None:
                self._record_finished(tracked, "error")
                err = EngineGenerateError(f"the engine failed while running request {parent_id}: {exc!r}")
                err.__cause__ = exc
                tracked.collector.put(err)
        if batch.outputs:
            for out in batch.outputs:
                if not out.new_token_ids:
                    continue
                parent_id = self._owner_of(out.req_id)
                tracked = self._tracked.get(parent_id) if parent_id is not None else None
                if tracked is not None:
                    tracked.metrics.on_output(len(out.new_token_ids), out.first_scheduled_time, now, iteration)
            results, to_abort = self.output_processor.process(batch.outputs)
            self.engine_core.abort_requests(to_abort)
            for ro in results:
                tracked = self._tracked.get(ro.request_id)
                if tracked is None:
                    continue
                if ro.finished:
                    reason = ro.outputs[0].finish_reason if isinstance(ro, RequestOutput) and ro.outputs else "stop"
                    self._record_finished(tracked, reason or "stop")
                tracked.collector.put(ro)
        if not self.log_stats:
            return
        stats = batch.scheduler_stats if batch.scheduler_stats is not None else SchedulerStats()
        for stat_logger in self.stat_loggers:
            stat_logger.record_iteration(stats, iteration)

    def _record_finished(self, tracked: _Tracked, reason: str) -> None:
        record = tracked.metrics.finish(reason, time.time())
        if record is None or not self.log_stats:
            return
        for stat_logger in self.stat_loggers:
            stat_logger.record_finished(record)

    # -- called on the core thread --------------------------------------------------------
    def _from_core_thread(self, batch: EngineCoreOutputs) -> None:
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._on_step, batch)
        except RuntimeError:
            pass  # the loop closed under us; its requests are gone with it

    def _core_died(self, exc: BaseException) -> None:
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, exc)
        except RuntimeError:
            pass

    def _fail_all(self, exc: BaseException) -> None:
        for tracked in list(self._tracked.values()):
            tracked.collector.put(exc if isinstance(exc, EngineDeadError)
                                  else EngineDeadError(f"the engine core died: {exc!r}"))
            self._record_finished(tracked, "error")


# vLLM's older name.
AsyncLLMEngine = AsyncLLM
