"""``distributed_executor_backend='uni'``: the one worker in the engine's own process (no copies, no IPC)."""

from __future__ import annotations

from typing import Any

from pagoda.executor.abstract import Executor, ExecutorFailedError
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.worker import Worker


class UniProcExecutor(Executor):
    backend_name = "uni"

    def _init_executor(self) -> None:
        if self.parallel_config.world_size != 1:
            raise ExecutorFailedError("the uni executor runs exactly one rank")
        self.driver_worker = Worker(self.config, self.platform, rank=0, in_engine_process=True)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # the per-step path: no list, no lookup by name
        out = self.driver_worker.execute_model(scheduler_output)
        assert out is not None
        return out

    @property
    def driver_runner(self) -> ModelRunner:
        """The model runner itself (tests and tools inspect it in-process)."""
        return self.driver_worker.runner

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
