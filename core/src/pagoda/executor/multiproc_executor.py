"""``distributed_executor_backend='mp'``: one spawned process per rank on this machine.

Each step the engine pickles the ``SchedulerOutput`` once and writes the same
bytes down every worker's pipe; every rank runs the step (the tensor-parallel
collectives run among the workers on the platform's process group), the output
rank replies with the sampled tokens and the others with ``None``, so a rank
that failed is noticed at once. With pipeline parallelism the engine sends the
next step before the last stage answered this one (``non_block=True``): each
rank runs its steps in order, so while stage 2 runs step k stage 1 runs k + 1.

Failure handling: the executor waits on the replies *and* on the workers'
process sentinels, so a worker that dies mid-step turns into an
``ExecutorFailedError`` (naming the rank and its exit code) instead of a hang;
any failure stops every worker (the others may be blocked in a collective with
the lost rank). Workers die with the engine: each holds the read end of a pipe
whose only write end the engine keeps, and a watchdog thread exits the worker
when it reads end-of-file, however the engine went away.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import traceback
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.distributed import get_open_port
from pagoda.executor.abstract import Executor
from pagoda.executor.step_futures import StepQueue
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Seconds a worker may take to start (spawn, imports, joining the group, loading its slice).
_STARTUP_TIMEOUT_S = 600.0
# Seconds shutdown waits for a worker to exit on its own before it is terminated, then killed.
_SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor(Executor):
    backend_name = "mp"

    def _init_executor(self) -> None:
        world_size = self.parallel_config.world_size
        ctx = multiprocessing.get_context("spawn")
        # loopback rendezvous: one machine, nothing listens on another interface
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self._failed: str | None = None
        self._closed = False
        self._steps = StepQueue()
        self._death_r, self._death_w = ctx.Pipe(duplex=False)
        self.workers: list[BaseProcess] = []
        self.conns: list[Connection] = []
        env_before = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")}
        # gloo picks its interface from the host name otherwise (may be unroutable in a sandbox)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main, name=f"pagoda-worker-{rank}", daemon=True,
                    args=(self.config, self.platform.name, rank, init_method, child, self._death_r),
                )
                proc.start()
                child.close()
                self.workers.append(proc)
                self.conns.append(parent)
        finally:
            for key, value in env_before.items():
                if value is None:
                    os.environ.pop(key, None)
        self._death_r.close()  # only the workers hold the read end
        try:
            self._gather(timeout=_STARTUP_TIMEOUT_S, what="start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d worker processes (pids %s) on %s", world_size,
                    [p.pid for p in self.workers], init_method)

    # -- the rpc -----------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """As ``Executor.collective_rpc``; ``timeout`` seconds without every reply fails the executor (hung)."""
        # the replies of the steps in flight come first down the same pipes
        self._steps.drain()
        self._send(method, args, kwargs)
        return self._gather(timeout=timeout, what=method)

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        self.check_health()
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self._fail(f"could not reach a worker: {exc!r}")

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._execute_model_non_block(scheduler_output).result()

    def _execute_model_non_block(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send the step to every rank and return at once; each rank runs its steps in the order sent.

        A stage before the last answers as soon as it has passed its activations on, so it reads the
        next step while the later stages still run this one.
        """
        self._send("execute_model", (scheduler_output,), None)
        # a worker that stops answering (deadlocked collective, stopped process) must not hang the engine
        timeout = float(envs.PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS)
        return self._steps.submit(lambda: self._collect_step(timeout), self._replies_ready)

    def _collect_step(self, timeout: float) -> ModelRunnerOutput:
        self._raise_if_failed_or_closed()
        return self._output(self._gather(timeout=timeout, what="execute_model"))

    def _replies_ready(self) -> bool:
        return self._failed is None and not self._closed and all(conn.poll() for conn in self.conns)

    def _gather(self, timeout: float | None, what: str) -> list[Any]:
        """Every rank's reply, in rank order; a death, an error or a timeout fails the executor."""
        results: list[Any] = [None] * len(self.conns)
        pending = dict(enumerate(self.conns))
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.workers)}
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout)
            if not ready:
                self._fail(f"workers {sorted(pending)} did not answer {what} within {timeout:.0f} s (hung)")
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._fail(self._death_message(rank, what))
                if status == "error":
                    self._fail(f"worker rank {rank} failed in {what}:\n{value}")
                results[rank] = value
            for obj in ready:
                dead = sentinels.get(obj) if isinstance(obj, int) else None
                # a rank that exited with its reply still unread is read on the next pass
                if dead is not None and dead in pending and not pending[dead].poll():
                    self._fail(self._death_message(dead, what))
        return results

    def _death_message(self, rank: int, what: str) -> str:
        proc = self.workers[rank]
        proc.join(1.0)
        return f"worker rank {rank} (pid {proc.pid}) died during {what} (exit code {proc.exitcode})"

    # -- health and shutdown -----------------------------------------------------------
    def check_health(self) -> None:
        self._raise_if_failed_or_closed()
        for rank, proc in enumerate(self.workers):
            if not proc.is_alive():
                self._fail(f"worker rank {rank} (pid {proc.pid}) is gone (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", (), {})))
            except OSError:
                pass  # already gone
        for proc in self.workers:
            proc.join(_SHUTDOWN_GRACE_S)
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
                proc.join(_SHUTDOWN_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self._death_w.close()

    def __del__(self) -> None:
        # a forgotten executor must not leave processes behind (they exit on the death pipe anyway)
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _watch_parent(death_r: Connection) -> None:
    """Exit this worker as soon as the engine's end of the death pipe closes."""
    try:
        death_r.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _worker_main(config: EngineConfig, platform_name: str, rank: int, init_method: str,
                 conn: Connection, death_r: Connection) -> None:
    threading.Thread(target=_watch_parent, args=(death_r,), name="pagoda-parent-watch", daemon=True).start()
    try:
        from pagoda.worker.process import init_worker_process
        from pagoda.worker.worker import Worker

        # the engine's decisions, not this process's: its plugins, in-script models and platform
        platform = init_worker_process(config, platform_name)
        worker = Worker(config, platform, rank, init_method, in_engine_process=False)
        worker.init_device()
        worker.load_model()
    except BaseException:  # noqa: BLE001 - reported to the engine, which fails the start-up
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine is gone
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - the engine decides; this rank reports
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
    from pagoda.distributed import destroy_distributed_environment

    destroy_distributed_environment()
