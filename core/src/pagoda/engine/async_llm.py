"""AsyncLLM: the engine for servers; async generators of RequestOutputs.

Layout: the engine core (schedule -> execute -> update) runs alone in a
background thread. Everything around it runs on the asyncio loop: tokenizing
and validating prompts, detokenizing, stop strings, per-request collectors,
metrics. The two sides meet in two places only:

* a command queue the core thread drains between steps (new requests, aborts);
* ``loop.call_soon_threadsafe`` that hands each step's raw token outputs back.

So a step never waits on HTTP, JSON or the tokenizer, and the event loop never
waits on a step (torch releases the GIL inside its kernels). Why a thread and
not a process on CPU is measured in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.scheduler.output import EngineCoreOutput
from pagoda.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long the idle core thread sleeps on its queue before re-checking shutdown.
_IDLE_POLL_S = 0.5


class EngineDeadError(RuntimeError):
    """The core thread is gone; no request can be served any more."""


class EngineGenerateError(RuntimeError):
    """The engine failed while computing this request (an internal error, not bad input)."""


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
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, Exception) or self.output is None or isinstance(self.output, Exception):
            if not isinstance(self.output, Exception):
                self.output = item
        elif self.kind == RequestOutputKind.DELTA:
            _merge_delta(self.output, item)
        else:
            self.output = item
        self.ready.set()

    async def get(self) -> RequestOutput:
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

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
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
    """Frontend bookkeeping of one user request (for metrics and cleanup)."""

    collector: RequestOutputCollector
    arrival_time: float
    children: list[Request] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    recorded: bool = False


class _CoreClient:
    """The frontend LLMEngine's add/abort calls, turned into commands for the core thread.

    ``LLMEngine.add_request`` / ``abort_request`` keep doing the frontend work
    (tokenize, validate, build child requests, output-processor state).
    """

    def __init__(self, commands: queue.SimpleQueue[tuple[str, Any]], on_add: Any) -> None:
        self._commands = commands
        self._on_add = on_add

    def add_request(self, request: Request) -> None:
        self._on_add(request)
        self._commands.put(("add", request))

    def abort_requests(self, request_ids: Any) -> None:
        ids = list(request_ids)
        if ids:
            self._commands.put(("abort", ids))


class AsyncLLM:
    """vLLM's AsyncLLM: ``async for out in engine.generate(prompt, params, request_id)``."""

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.engine = LLMEngine(config)
        self.config = config
        self.model_config = config.model
        self.max_model_len = self.engine.max_model_len
        self.tokenizer = self.engine.get_tokenizer()
        self._core = self.engine.core
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._adding: _Tracked | None = None
        self.engine.attach_core_client(_CoreClient(self._commands, self._on_child_added))
        self.stat_loggers: list[StatLogger] = []
        self.log_stats = log_stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead_error: BaseException | None = None
        self._prev_preemptions = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, log_stats: bool = True) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), log_stats=log_stats)

    # -- public API ---------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_tokenizer_async(self) -> Any:
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    async def check_health(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self._dead_error!r}")
        if self._thread is not None and not self._thread.is_alive() and not self._stopping.is_set():
            raise EngineDeadError("the engine core thread stopped")

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Validate, tokenize and queue a request; bad input raises ValueError here, before the core sees it.

        The caller must iterate the returned stream to its end or call ``abort()`` on it.
        """
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self._dead_error!r}")
        self._ensure_started()
        collector = RequestOutputCollector(sampling_params.output_kind)
        tracked = _Tracked(collector, time.time())
        self._adding = tracked
        try:
            self.engine.add_request(request_id, prompt, sampling_params, arrival_time=tracked.arrival_time, priority=priority)
        finally:
            self._adding = None
        self._tracked[request_id] = tracked
        return RequestStream(self, request_id, collector)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        **_: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (vLLM's signature)."""
        stream = self.add_request(request_id, prompt, sampling_params, priority)
        async for out in stream:
            yield out

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; their streams end with a finished output (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            tracked = self._tracked.get(rid)
            self._abort_local(rid)
            if tracked is not None:
                tracked.collector.put(RequestOutput(rid, None, [], None, [], finished=True))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # -- frontend internals (event loop thread) -----------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed() and self._tracked:
                raise RuntimeError("AsyncLLM is serving requests on another event loop")
            self._loop = loop  # a new loop (e.g. a second asyncio.run) takes over delivery
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._core_loop, name="pagoda-engine-core", daemon=True)
        self._thread.start()

    def _on_child_added(self, request: Request) -> None:
        tracked = self._adding
        if tracked is not None:
            tracked.children.append(request)
            tracked.num_prompt_tokens = request.num_prompt_tokens

    def _abort_local(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        self.engine.abort_request(request_id)
        if tracked is not None:
            self._record_finished(request_id, tracked, "abort")

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def _owner_of(self, child_id: str) -> str | None:
        state = self.engine.output_processor.children.get(child_id)
        return state.parent_id if state is not None else None

    def _on_step(self, outputs: list[EngineCoreOutput], stats: SchedulerStats, failed: dict[str, BaseException]) -> None:
        """Runs on the event loop: detokenize, stop strings, deliver, metrics."""
        now = time.time()
        iteration = IterationStats()
        for child_id, exc in failed.items():
            parent_id = self._owner_of(child_id)
            if parent_id is None:
                continue
            tracked = self._tracked.get(parent_id)
            self.engine.abort_request(parent_id)
            if tracked is not None:
                self._record_finished(parent_id, tracked, "error")
                err = EngineGenerateError(f"the engine failed while running request {parent_id}: {exc!r}")
                err.__cause__ = exc
                tracked.collector.put(err)
        if outputs:
            for out in outputs:
                parent_id = self._owner_of(out.req_id)
                tracked = self._tracked.get(parent_id) if parent_id is not None else None
                if tracked is None or not out.new_token_ids:
                    continue
                if tracked.first_token_time is None:
                    tracked.first_token_time = now
                    iteration.num_prompt_tokens += tracked.num_prompt_tokens
                elif tracked.last_token_time is not None and len(tracked.children) == 1:
                    # several tokens in one step share its latency
                    per_token = (now - tracked.last_token_time) / len(out.new_token_ids)
                    tracked.inter_token_latencies.extend([per_token] * len(out.new_token_ids))
                tracked.last_token_time = now
                tracked.num_generation_tokens += len(out.new_token_ids)
                iteration.num_generation_tokens += len(out.new_token_ids)
            results, to_abort = self.engine.output_processor.process(outputs)
            if to_abort:
                self._commands.put(("abort", to_abort))
            for ro in results:
                tracked = self._tracked.get(ro.request_id)
                if tracked is None:
                    continue
                if ro.finished:
                    reason = ro.outputs[0].finish_reason if ro.outputs else "stop"
                    self._record_finished(ro.request_id, tracked, reason or "stop")
                tracked.collector.put(ro)
        for stat_logger in self.stat_loggers:
            stat_logger.record_iteration(stats, iteration)

    def _record_finished(self, request_id: str, tracked: _Tracked, reason: str) -> None:
        if tracked.recorded:
            return
        tracked.recorded = True
        if not self.stat_loggers:
            return
        now = time.time()
        first_sched = min((c.first_scheduled_time for c in tracked.children if c.first_scheduled_time), default=None)
        stats = FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - tracked.arrival_time,
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_generation_tokens=tracked.num_generation_tokens,
            queue_time=(first_sched - tracked.arrival_time) if first_sched is not None else None,
            ttft=(tracked.first_token_time - tracked.arrival_time) if tracked.first_token_time is not None else None,
            inter_token_latencies=tracked.inter_token_latencies,
            decode_time=(tracked.last_token_time - tracked.first_token_time)
            if tracked.first_token_time is not None and tracked.last_token_time is not None else None,
        )
        for stat_logger in self.stat_loggers:
            stat_logger.record_finished(stats)

    # -- the core thread -------------------------------------------------------------
    def _drain_commands(self, block: bool) -> None:
        core = self._core
        try:
            cmd, arg = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                core.add_request(arg)
            elif cmd == "abort":
                core.abort_requests(arg)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _scheduler_stats(self) -> SchedulerStats:
        core = self._core
        prefix = core.kv_cache_manager.make_prefix_cache_stats()
        preemptions = core.scheduler.num_preemptions
        stats = SchedulerStats(
            num_running_reqs=core.scheduler.num_running,
            num_waiting_reqs=core.scheduler.num_waiting,
            kv_cache_usage=core.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=preemptions - self._prev_preemptions,
        )
        self._prev_preemptions = preemptions
        return stats

    def _deliver(self, *args: Any) -> None:
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._on_step, *args)
        except RuntimeError:
            pass  # the loop closed under us; its requests are gone with it

    def _core_loop(self) -> None:
        core = self._core
        try:
            while not self._stopping.is_set():
                idle = not core.has_unfinished_requests() and not core.scheduler.has_finished_ids_pending()
                self._drain_commands(block=idle)
                if self._stopping.is_set():
                    break
                if not core.has_unfinished_requests() and not core.scheduler.has_finished_ids_pending():
                    # an abort-only batch still changes the gauges
                    self._deliver([], self._scheduler_stats(), {})
                    continue
                failed: dict[str, BaseException] = {}
                try:
                    outputs = core.step()
                except Exception as exc:  # noqa: BLE001 - one bad step must not stop the server
                    logger.exception("engine step failed; failing the requests it ran")
                    outputs = []
                    victims = [r.request_id for r in list(core.scheduler.running)]
                    core.scheduler.finish_requests(victims, RequestStatus.FINISHED_ERROR)
                    failed = {rid: exc for rid in victims}
                self._deliver(outputs, self._scheduler_stats(), failed)
        except BaseException as exc:  # the thread itself broke: nothing more can be served
            logger.exception("engine core thread died")
            self._dead_error = exc
            try:
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._fail_all, exc)
            except RuntimeError:
                pass

    def _fail_all(self, exc: BaseException) -> None:
        for rid, tracked in list(self._tracked.items()):
            tracked.collector.put(EngineDeadError(f"the engine core died: {exc!r}"))
            self._record_finished(rid, tracked, "error")


# vLLM's older name.
AsyncLLMEngine = AsyncLLM
