"""Engine-core clients for cores in their own processes (vLLM V1's ``MPClient`` / ``DPLBAsyncMPClient``).

``MPClient`` spawns one engine-core process (``pagoda.engine.core_process``;
replica 0 takes the standby core `pagoda serve` spawned ahead of the config
instead), sends it the config and talks to it over two ZMQ IPC sockets: commands (new requests, aborts) go in
pickled, each step's ``EngineCoreOutputs`` come back pickled. A receiver
thread in the API process waits on the output socket and on the process's
sentinel at once, so outputs and the process's death are both noticed at
once; it hands outputs to ``on_outputs`` and a death to ``on_dead`` exactly as
``ThreadedClient`` does, so ``AsyncLLM`` does not care which client it has.

``DPLBAsyncMPClient`` (``data_parallel_size > 1``) runs one ``MPClient`` per
replica and sends each new request to the replica with the fewest unfinished
requests it was given (ties: the lowest index), or, with prefix caching on, to
a replica at most ``PREFIX_ROUTING_SLACK`` busier that was already sent the
longest run of the prompt's leading KV blocks (pagoda-only); an abort goes to
the replica that holds the request.

No process is left behind: ``shutdown`` asks the core to stop, then
terminates and kills it if it does not; a finalizer does the same if the
client is dropped without ``shutdown``; and the core itself exits when the
API process dies (it watches a pipe whose other end only the parent holds).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagoda.engine.core_proc import dumps, loads
from pagoda.engine.errors import EngineDeadError
from pagoda.metrics.stats import SchedulerStats
from pagoda.platforms import Platform

logger = logging.getLogger(__name__)

# A replica that already holds a request's prompt prefix gets it while it has at most this many more
# unfinished requests than the least loaded one (so a shared system prompt cannot pile everything on one).
PREFIX_ROUTING_SLACK = 1
# Prompt blocks remembered per replica for prefix routing (oldest forgotten first).
_MAX_REMEMBERED_BLOCKS = 65536
# How long the API process waits for an engine core to load its model.
STARTUP_TIMEOUT_S = 600.0
_RECV_POLL_MS = 1000
# How often a send that cannot go out yet (no peer, or the core's queue full) looks whether the core died.
_SEND_POLL_MS = 50


class EngineCoreProcessDied(RuntimeError):
    """The engine-core process exited while it was serving."""


class EngineCoreStartupError(RuntimeError):
    """The engine-core process failed before its model was loaded."""


def _reap(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait for ``proc``; terminate, then kill it, if it does not exit."""
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("engine core process %s did not stop in %.1f s; terminating it", proc.pid, timeout)
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)


class MPClient:
    """One engine core in a spawned process; the same face as ``ThreadedClient``."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[BaseException], None],
        replica_rank: int = 0,
        wait_ready: bool = True,
    ) -> None:
        from pagoda.engine.core_process import CoreProcess, take_standby_core

        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.replica_rank = replica_rank
        self.dead_error: BaseException | None = None
        self._stopping = threading.Event()
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # utility calls waiting for the core's answer: id -> future
        self._call_ids = itertools.count()
        self._calls: dict[int, Future[Any]] = {}
        # the standby core `pagoda serve` spawned first thing (already importing), else a new one
        # a core spawned now gets its config at once: unpickling it imports whatever transformers
        # modules it holds, so nothing is imported ahead in case (3-4 s a GGUF model's core never needs)
        self._core = take_standby_core(replica_rank) or CoreProcess(replica_rank, config_imports=False)
        self.proc = self._core.proc
        self._in = self._core.inp
        self._out = self._core.out
        self._parent_end = self._core.parent_end
        self._sockdir = self._core.sockdir
        self.supported_tasks: tuple[str, ...] = ()
        try:
            self._core.send_config(config, platform, STARTUP_TIMEOUT_S)
        except BaseException:
            self._core.close()
            raise
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the core has loaded its model; a failed start raises EngineCoreStartupError."""
        try:
            self.supported_tasks = tuple(self._wait_ready())
        except BaseException:
            self._core.close()
            raise
        logger.info("engine core %d runs in process %d", self.replica_rank, self.proc.pid)

    def _wait_ready(self) -> Any:
        import zmq

        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        events = dict(poller.poll(int(STARTUP_TIMEOUT_S * 1000)))
        if self._out in events:
            kind, payload = loads(self._out.recv())
            if kind == "ready":
                return payload
            if kind == "startup_failed":
                raise EngineCoreStartupError(f"the engine core process failed to start:\n{payload}")
            raise EngineCoreStartupError(f"the engine core process sent {kind!r} before it was ready")
        if self.proc.sentinel in events:
            self.proc.join(1.0)
            raise EngineCoreStartupError(
                f"the engine core process exited with code {self.proc.exitcode} before it was ready")
        raise EngineCoreStartupError(f"the engine core process was not ready after {STARTUP_TIMEOUT_S:.0f} s")

    # -- front-end side --------------------------------------------------------------
    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive, name=f"pagoda-core-client-{self.replica_rank}",
                                            daemon=True)
            self._thread.start()

    def _send(self, kind: str, payload: Any) -> None:
        self._send_frame(dumps(kind, payload))

    def _send_frame(self, frame: Any) -> None:
        """Send one command; raises EngineDeadError instead of blocking when the core is gone.

        A PUSH socket blocks while it has no peer, and a killed core's connection is gone the moment it
        dies — before the receiver thread has noticed — so a plain ``send`` from the event loop could hang
        the whole server (every request, /health and the exit on engine death with it)."""
        import zmq

        with self._send_lock:
            while True:
                if self.dead_error is not None:
                    raise EngineDeadError(f"the engine core died: {self.dead_error}")
                try:
                    self._in.send(frame, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    if not self.proc.is_alive():
                        raise EngineDeadError(f"the engine core process (pid {self.proc.pid}) is gone, "
                                              f"exit code {self.proc.exitcode}") from None
                    self._in.poll(_SEND_POLL_MS, zmq.POLLOUT)

    def add_request(self, request: EngineCoreRequest) -> None:
        try:
            frame = dumps("add", request)
        except Exception as exc:  # e.g. a logits processor defined in a closure
            raise ValueError(f"the request cannot be sent to the engine core process (it must pickle): {exc}") from exc
        self._send_frame(frame)

    def add_beam_search(self, group: Any, root: EngineCoreRequest) -> None:
        raise NotImplementedError("beam search runs with the in-process engine core (LLMEngine) only")

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and self.dead_error is None:
            try:
                self._send("abort", ids)
            except EngineDeadError:
                pass  # a dead core holds nothing to abort; the death itself reaches every stream

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """``EngineCore.<method>(*args)`` in the core process between steps; result or error in the future."""
        future: Future[Any] = Future()
        with self._send_lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send("utility", (call_id, method, args))
        return future

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive() and self.dead_error is None

    @property
    def stopped_unexpectedly(self) -> bool:
        return not self.proc.is_alive() and not self._stopping.is_set()

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.proc.is_alive():
            try:
                self._send("shutdown", None)
            except Exception:  # noqa: BLE001 - the socket is going away anyway
                pass
            _reap(self.proc, timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._parent_end.close()
        self._core.close()

    # -- the receiver thread -------------------------------------------------------------
    def _receive(self) -> None:
        import zmq

        # a socket of its own thread: only this thread touches _out from here on
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(_RECV_POLL_MS))
                if self._out in events:
                    # drain before looking at the sentinel: outputs sent just before a death still count
                    while True:
                        try:
                            kind, payload = loads(self._out.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if kind == "outputs":
                            self._on_outputs(payload)
                        elif kind == "utility":
                            call_id, result, error = payload
                            future = self._calls.pop(call_id, None)
                            if future is not None:
                                future.set_exception(error) if error is not None else future.set_result(result)
                        elif kind == "dead":
                            raise EngineCoreProcessDied(f"the engine core loop died:\n{payload}")
                    continue
                if self.proc.sentinel in events and not self._stopping.is_set():
                    self.proc.join(1.0)
                    raise EngineCoreProcessDied(
                        f"the engine core process (pid {self.proc.pid}) died unexpectedly, exit code {self.proc.exitcode}")
        except BaseException as exc:  # noqa: BLE001 - anything here means nothing more is served
            if self._stopping.is_set():
                return
            logger.error("engine core %d is gone: %s", self.replica_rank, exc)
            self.dead_error = exc
            for future in list(self._calls.values()):
                future.set_exception(exc)
            self._calls.clear()
            self._on_dead(exc)
            # the process may be a live husk (its loop died): stop it, so nothing is left behind
            if self.proc.is_alive():
                _reap(self.proc, 2.0)


class DPLBAsyncMPClient:
    """``data_parallel_size`` engine cores, one process each; a new request goes to the least loaded."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[BaseException], None],
        wait_ready: bool = True,
    ) -> None:
        size = config.parallel_config.data_parallel_size
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._lock = threading.Lock()
        # request id -> the replica holding it; per-replica count of those requests
        self._owner: dict[str, int] = {}
        self._load = [0] * size
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in range(size)]
        # prefix-cache-aware routing (beyond vLLM's DPLB client): the prompt blocks each replica was sent
        self._prefix_routing = config.cache_config.enable_prefix_caching
        self._seen_blocks: list[OrderedDict[Any, None]] = [OrderedDict() for _ in range(size)]
        self._dead_reported = False
        self.engines: list[MPClient] = []
        self.supported_tasks: tuple[str, ...] = ()
        try:
            # all start at once (imports and model loads overlap), then each is waited for
            for rank in range(size):
                self.engines.append(MPClient(config, platform, self._outputs_of(rank), self._died, replica_rank=rank,
                                             wait_ready=False))
        except BaseException:
            self.shutdown(1.0)
            raise
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every replica has loaded its model; one failed start stops them all."""
        try:
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown(1.0)
            raise
        tasks = {e.supported_tasks for e in self.engines}
        assert len(tasks) == 1, f"replicas disagree on the model's tasks: {tasks}"
        self.supported_tasks = self.engines[0].supported_tasks

    # -- routing -------------------------------------------------------------------------
    def _pick(self, block_hashes: list[Any]) -> int:
        """The least loaded replica; or, within ``PREFIX_ROUTING_SLACK`` of it, the one that was sent the
        longest run of this prompt's leading KV blocks (so it likely still caches them)."""
        fewest = min(self._load)
        best = min(range(len(self._load)), key=lambda i: (self._load[i], i))
        if not self._prefix_routing or not block_hashes:
            return best
        best_hits = 0
        for rank, seen in enumerate(self._seen_blocks):
            if self._load[rank] > fewest + PREFIX_ROUTING_SLACK:
                continue
            hits = 0
            for h in block_hashes:  # chained hashes: a prefix matches block by block from the start
                if h not in seen:
                    break
                hits += 1
            if hits > best_hits or (hits == best_hits and hits and self._load[rank] < self._load[best]):
                best, best_hits = rank, hits
        return best

    def _remember_blocks(self, rank: int, block_hashes: list[Any]) -> None:
        seen = self._seen_blocks[rank]
        for h in block_hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > _MAX_REMEMBERED_BLOCKS:
            seen.popitem(last=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            rank = self._pick(request.block_hashes)
            self._owner[request.request_id] = rank
            self._load[rank] += 1
            if self._prefix_routing:
                self._remember_blocks(rank, request.block_hashes)
        try:
            self.engines[rank].add_request(request)
        except BaseException:
            self._release([request.request_id])
            raise

    def add_beam_search(self, group: Any, root: EngineCoreRequest) -> None:
        raise NotImplementedError("beam search runs with the in-process engine core (LLMEngine) only")

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                rank = self._owner.get(rid)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self.engines[rank].abort_requests(ids)
        # the core confirms nothing for an abort: the request stops counting now
        self._release(itertools.chain.from_iterable(by_rank.values()))

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """The call on every replica (each holds its own adapters); the first replica's result, or the first error."""
        futures = [engine.call_utility(method, *args) for engine in self.engines]
        combined: Future[Any] = Future()

        def done(_: Future[Any]) -> None:
            if all(f.done() for f in futures) and not combined.done():
                error = next((f.exception() for f in futures if f.exception() is not None), None)
                combined.set_exception(error) if error is not None else combined.set_result(futures[0].result())

        for f in futures:
            f.add_done_callback(done)
        return combined

    def _release(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                rank = self._owner.pop(rid, None)
                if rank is not None:
                    self._load[rank] -= 1

    def replica_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    # -- outputs ---------------------------------------------------------------------------
    def _outputs_of(self, rank: int) -> Callable[[EngineCoreOutputs], None]:
        def on_outputs(batch: EngineCoreOutputs) -> None:
            done = [o.req_id for o in batch.outputs if o.finish_reason is not None]
            done.extend(batch.failed)
            if done:
                self._release(done)
            if batch.scheduler_stats is not None:
                batch.scheduler_stats = self._merge_stats(rank, batch.scheduler_stats)
            self._on_outputs(batch)

        return on_outputs

    def _merge_stats(self, rank: int, stats: SchedulerStats) -> SchedulerStats:
        """The gauges of every replica together (the latest of each); counters are this batch's own."""
        with self._lock:
            self._stats[rank] = stats
            latest = list(self._stats)
        return SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in latest),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in latest),
            kv_cache_usage=sum(s.kv_cache_usage for s in latest) / len(latest),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            running_lora_adapters=_sum_counts(s.running_lora_adapters for s in latest),
            waiting_lora_adapters=_sum_counts(s.waiting_lora_adapters for s in latest),
            max_lora=stats.max_lora,
        )

    def _died(self, exc: BaseException) -> None:
        # one replica gone: its requests cannot finish, and the server must not look healthy
        with self._lock:
            first = not self._dead_reported
            self._dead_reported = True
        if first:
            self._on_dead(exc)

    # -- the ThreadedClient face -----------------------------------------------------------
    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    @property
    def dead_error(self) -> BaseException | None:
        return next((e.dead_error for e in self.engines if e.dead_error is not None), None)

    @property
    def is_alive(self) -> bool:
        return all(e.is_alive for e in self.engines)

    @property
    def stopped_unexpectedly(self) -> bool:
        return any(e.stopped_unexpectedly for e in self.engines)

    def shutdown(self, timeout: float = 5.0) -> None:
        for engine in self.engines:
            engine.shutdown(timeout)


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for name, n in c.items():
            total[name] = total.get(name, 0) + n
    return total


def make_async_client(
    config: EngineConfig,
    platform: Platform,
    on_outputs: Callable[[EngineCoreOutputs], None],
    on_dead: Callable[[BaseException], None],
    engine_core_process: bool = False,
    wait_ready: bool = True,
) -> Any:
    """AsyncLLM's client: a thread, a process, or one process per DP replica.

    PAGODA_ENABLE_V1_MULTIPROCESSING decides when it is set; else ``engine_core_process`` (the
    caller's default: `pagoda serve` asks for the process), else a thread. A multi-rank executor
    (tensor or pipeline parallel) keeps the thread unless the variable asks for the process.
    ``wait_ready=False``: a process client returns once its core has the config (it loads the model
    meanwhile); the caller then calls ``wait_ready()``. A thread client is ready when built.
    """
    from pagoda.engine.core_client import ThreadedClient
    from pagoda.engine.core_process import discard_standby_core

    if engine_core_in_process(config.parallel_config.world_size, config.parallel_config.data_parallel_size,
                              engine_core_process):
        if config.parallel_config.data_parallel_size > 1:
            return DPLBAsyncMPClient(config, platform, on_outputs, on_dead, wait_ready=wait_ready)
        return MPClient(config, platform, on_outputs, on_dead, wait_ready=wait_ready)
    # a standby core `pagoda serve` spawned ahead of the config has nothing to do
    discard_standby_core()
    return ThreadedClient(config, platform, on_outputs, on_dead)


def engine_core_in_process(world_size: int, data_parallel_size: int, engine_core_process: bool) -> bool:
    """Whether the engine core runs in a process of its own (``make_async_client``'s rule)."""
    from pagoda import envs

    if data_parallel_size > 1:
        return True
    if envs.is_set("PAGODA_ENABLE_V1_MULTIPROCESSING"):
        return bool(envs.PAGODA_ENABLE_V1_MULTIPROCESSING)
    return engine_core_process and world_size == 1
