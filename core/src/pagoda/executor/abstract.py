"""The executor interface: what the engine core asks of its workers, wherever they run.

vLLM's ``Executor`` names: one executor per engine owns every rank's ``Worker``
and broadcasts each step's ``SchedulerOutput`` to them; ``distributed_executor_backend``
picks the class. A new backend (Ray, another launcher) implements ``collective_rpc``,
``check_health`` and ``shutdown``; the rest is built on those.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Literal, NoReturn, overload

from pagoda.config import EngineConfig
from pagoda.platforms import Platform
from pagoda.plugins.specs import import_object
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import MemoryReport

logger = logging.getLogger(__name__)

# distributed_executor_backend -> the executor class; "ray" is written beside this one
_BACKENDS: dict[str, str] = {
    "uni": "pagoda.executor.uniproc_executor:UniProcExecutor",
    "mp": "pagoda.executor.multiproc_executor:MultiprocExecutor",
    "ray": "pagoda.executor.ray_executor:RayDistributedExecutor",
    "external_launcher": "pagoda.executor.external_launcher:ExecutorWithExternalLauncher",
}


class ExecutorFailedError(RuntimeError):
    """A worker died, hung or raised: the executor serves no more steps."""


class Executor(ABC):
    # the backend name this class serves (``distributed_executor_backend``)
    backend_name: str = ""

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.executor_backend
        ref = _BACKENDS.get(backend)
        if ref is None:
            raise ValueError(f"unknown distributed_executor_backend {backend!r} (one of {', '.join(_BACKENDS)})")
        try:
            cls = import_object(ref)
        except ImportError as exc:
            raise ValueError(f"distributed_executor_backend={backend!r} is unavailable: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"{ref} is no Executor")
        return cls

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.parallel_config = config.parallel_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start every rank's worker, join the process groups and load the model slices."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every rank; their results in rank order.

        A failure on any rank raises ``ExecutorFailedError`` and leaves the executor failed.
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raise ``ExecutorFailedError`` if any worker is gone or failed."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; idempotent."""

    # -- failure bookkeeping of executors whose workers live elsewhere (mp, ray) --------
    _failed: str | None = None  # the first failure; every later call reports it
    _closed: bool = False

    def _fail(self, message: str) -> NoReturn:
        """A worker died, hung or raised: remember why, stop every worker, raise."""
        logger.error("%s executor failed: %s", self.backend_name, message)
        self._failed = message
        self.shutdown()
        raise ExecutorFailedError(message)

    def _raise_if_failed_or_closed(self) -> None:
        if self._failed is not None:
            raise ExecutorFailedError(self._failed)
        if self._closed:
            raise ExecutorFailedError("the executor is shut down")

    # -- built on collective_rpc --------------------------------------------------------
    def initialize_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int) -> MemoryReport:
        """Each rank sizes and allocates its cache; the ranks then agree on the smallest block count."""
        reports: list[MemoryReport] = self.collective_rpc("init_kv_cache", (max_num_seqs, max_num_batched_tokens))
        fewest = min(r.num_blocks for r in reports)
        if any(r.num_blocks != fewest for r in reports):
            # one block id names a block in every rank's cache: all ranks hold the same count
            reports = self.collective_rpc("init_kv_cache", (max_num_seqs, max_num_batched_tokens, fewest))
        return reports[0]

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank; ``non_block``: return a future at once (vLLM's signature)."""
        if non_block:
            return self._execute_model_non_block(scheduler_output)
        return self._execute_model(scheduler_output)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._output(self.collective_rpc("execute_model", (scheduler_output,)))

    def _execute_model_non_block(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Executors whose ranks run several steps at once (``max_concurrent_batches > 1``) override
        this; here the step runs first and its future is returned done."""
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self._execute_model(scheduler_output))
        return future

    def _output(self, outputs: list[Any]) -> ModelRunnerOutput:
        out = outputs[self.output_rank]
        assert out is not None, "the output rank returned no step result"
        return out  # type: ignore[no-any-return]

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine may keep in flight (vLLM's name): one per pipeline stage where the
        executor returns futures, so every stage has a batch to run."""
        return 1

    def get_supported_tasks(self) -> tuple[str, ...]:
        return tuple(self.collective_rpc("get_supported_tasks")[self.output_rank])

    @property
    def output_rank(self) -> int:
        """The rank that returns sampled tokens: the last pipeline stage's first tensor-parallel rank."""
        return self.parallel_config.world_size - self.parallel_config.tensor_parallel_size
