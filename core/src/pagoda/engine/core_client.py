"""Engine-core clients: how a front end reaches the core (vLLM v1's ``EngineCoreClient``).

Both front ends (``LLMEngine``, ``AsyncLLM``) send ``EngineCoreRequest``s, beam
searches and aborts through a client and receive ``EngineCoreOutputs``: token
outputs, the ids of requests a failed step took down, and ``SchedulerStats``
(all in ``pagoda.engine.messages``). Nothing else crosses, so the core can move into another process (a client that pickles the
same calls) without touching either front end.

* ``InprocClient``: the core in the caller's thread; ``get_output()`` runs one step.
* ``ThreadedClient``: the core alone in a background thread; commands go
  through a queue drained between steps, outputs come back through a callback.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from pagoda.beam_search.group import BeamGroup
from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagoda.executor import ExecutorFailedError
from pagoda.lora.request import LoRARequest
from pagoda.metrics.stats import SchedulerStats
from pagoda.platforms import Platform

logger = logging.getLogger(__name__)

# EngineCore methods a front end may call between steps (call_utility), with a result back.
UTILITY_METHODS = frozenset({"add_lora", "remove_lora", "list_loras", "sleep", "wake_up", "is_sleeping",
                             "get_memory_bytes", "get_memory_usage", "set_cpu_share"})


def run_utility(core: EngineCore, method: str, args: tuple[Any, ...], future: Future[Any]) -> None:
    """Run one utility call on ``core``; its error goes to the caller, never up the core loop."""
    try:
        future.set_result(getattr(core, method)(*args))
    except Exception as exc:  # noqa: BLE001 - the caller's error (a bad adapter), not the engine's
        future.set_exception(exc)


# How long the idle core thread sleeps on its queue before re-checking shutdown.
_IDLE_POLL_S = 0.5


def step_and_hand_off(
    core: EngineCore,
    hand_off: Callable[[EngineCoreOutputs], None],
    portable: Callable[[Exception], BaseException] = lambda exc: exc,
) -> None:
    """One step of ``core``, its ``EngineCoreOutputs`` handed to ``hand_off`` (the core thread's callback,
    or the core process's output socket).

    A step that raises fails only the requests it ran, each reported with the error (``portable``
    makes it one that crosses a process boundary), and the loop goes on. An ``ExecutorFailedError``
    (a worker is gone) is handed off the same way, then raised: this engine is dead.
    """
    batch = EngineCoreOutputs()
    try:
        batch.outputs = core.step()
    except Exception as exc:  # noqa: BLE001 - one bad step must not stop the engine
        logger.exception("engine step failed; failing the requests it ran")
        error = portable(exc)
        batch.failed = {rid: error for rid in core.fail_running()}
        if isinstance(exc, ExecutorFailedError):
            hand_off(batch)
            raise
    batch.scheduler_stats = core.make_stats()
    hand_off(batch)


class EngineCoreClient(Protocol):
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_beam_search(self, group: BeamGroup, root: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """The core in the caller's thread: each ``get_output()`` is one step."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.core = EngineCore(config, platform)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def add_beam_search(self, group: BeamGroup, root: EngineCoreRequest) -> None:
        self.core.add_beam_search(group, root)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self.core.abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.core.step())

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.core.get_supported_tasks()

    def sleep(self, level: int) -> None:
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.core.make_stats()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedClient:
    """The core loop alone in a background thread.

    ``on_outputs`` is called from the core thread after every step (and after an
    abort-only batch, whose gauges changed); ``on_dead`` once if the thread
    itself breaks. Both must hand work over to their own thread, not do it there.
    A step that raises fails only the requests that were running; the loop goes on.
    """

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self.core = EngineCore(config, platform)
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.dead_error: BaseException | None = None

    def wait_ready(self) -> None:
        """Nothing to wait for: the core was built in the constructor (the process clients' face)."""

    # -- front-end side --------------------------------------------------------------
    def get_supported_tasks(self) -> tuple[str, ...]:
        # fixed once the core loaded its model (before the thread starts), so read directly
        return self.core.get_supported_tasks()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagoda-engine-core", daemon=True)
            self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._commands.put(("add", request))

    def add_beam_search(self, group: BeamGroup, root: EngineCoreRequest) -> None:
        self._commands.put(("beam", (group, root)))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self._commands.put(("abort", ids))

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """``EngineCore.<method>(*args)`` run by the core thread between steps (vLLM's utility calls): its
        result, or its exception, in the future; the core thread goes on either way."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"{method!r} is not an engine-core utility ({', '.join(sorted(UTILITY_METHODS))})")
        future: Future[Any] = Future()
        self._commands.put(("utility", (future, method, args)))
        return future

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopped_unexpectedly(self) -> bool:
        return self._thread is not None and not self._thread.is_alive() and not self._stopping.is_set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.core.shutdown()  # the workers, when they run in processes of their own

    # -- the core thread ---------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        core = self.core
        try:
            cmd, arg = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                core.add_request(arg)  # type: ignore[arg-type]
            elif cmd == "beam":
                core.add_beam_search(*arg)  # type: ignore[misc]
            elif cmd == "abort":
                core.abort_requests(arg)  # type: ignore[arg-type]
            elif cmd == "utility":
                future, method, args = arg  # type: ignore[misc]
                run_utility(core, method, args, future)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stopping.is_set():
                self._drain(block=not core.has_work())
                if self._stopping.is_set():
                    break
                if not core.has_work():
                    # an abort-only batch still changes the gauges
                    self._on_outputs(EngineCoreOutputs(scheduler_stats=core.make_stats()))
                    continue
                step_and_hand_off(core, self._on_outputs)
        except BaseException as exc:  # the thread itself broke: nothing more can be served
            logger.exception("engine core thread died")
            self.dead_error = exc
            self._on_dead(exc)
