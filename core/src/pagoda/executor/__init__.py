"""Executors: who runs the workers (vLLM's ``distributed_executor_backend``)."""

from pagoda.executor.abstract import Executor, ExecutorFailedError

__all__ = ["Executor", "ExecutorFailedError"]
