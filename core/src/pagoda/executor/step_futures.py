"""Steps in flight: ``execute_model(..., non_block=True)`` returns before the workers answer.

With pipeline parallelism the engine keeps several steps in flight (its batch queue); the workers run
them in the order they were sent and answer in that order. A ``StepFuture`` is a
``concurrent.futures.Future`` that no thread completes on its own: asking for its result (or whether
it is done) collects the answers of every earlier step first, in the engine's own thread, so an
executor that reads its workers' replies from ordered channels (the mp executor's pipes) never
mistakes one step's reply for another's. A failed collection fails that step and every later one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from pagoda.scheduler.output import ModelRunnerOutput


class StepFuture(Future[ModelRunnerOutput]):
    def __init__(self, queue: StepQueue, collect: Callable[[], ModelRunnerOutput], ready: Callable[[], bool]) -> None:
        super().__init__()
        self._queue = queue
        # blocks until every rank answered this step (or raises ExecutorFailedError)
        self._collect = collect
        # whether every rank's answer is there already (collecting would not block)
        self._ready = ready

    def done(self) -> bool:
        if not super().done() and self._queue.is_oldest(self) and self._ready():
            self._queue.collect_through(self)
        return super().done()

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if timeout is not None:
            # the executor bounds the wait itself (PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS fails a hung worker)
            raise ValueError("a StepFuture takes no timeout: the executor's PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS "
                             "bounds the wait")
        self._queue.collect_through(self)
        return super().result(0)


class StepQueue:
    """An executor's steps in flight, oldest first."""

    def __init__(self) -> None:
        self._pending: deque[StepFuture] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, collect: Callable[[], ModelRunnerOutput], ready: Callable[[], bool]) -> StepFuture:
        future = StepFuture(self, collect, ready)
        self._pending.append(future)
        return future

    def is_oldest(self, future: StepFuture) -> bool:
        return bool(self._pending) and self._pending[0] is future

    def collect_through(self, future: StepFuture) -> None:
        """Collect every step up to and including ``future`` (a no-op once it is done)."""
        while not Future.done(future) and self._pending:  # the plain check: done() would collect
            head = self._pending.popleft()
            try:
                head.set_result(head._collect())
            except BaseException as exc:  # noqa: BLE001 - the step's error is its future's
                self.fail_all(exc, head)
                return

    def drain(self) -> None:
        """Collect every step in flight (before a collective_rpc reads the same replies)."""
        if self._pending:
            self.collect_through(self._pending[-1])

    def fail_all(self, exc: BaseException, first: StepFuture | None = None) -> None:
        """The executor failed: this step and every later one end with its error."""
        if first is not None:
            first.set_exception(exc)
        while self._pending:
            self._pending.popleft().set_exception(exc)
