"""``distributed_executor_backend='ray'``: one Ray actor per rank, in a placement group.

vLLM's ``RayDistributedExecutor``: the engine joins a Ray cluster (``RAY_ADDRESS``
or an already initialised ``ray``), or starts a local one bound to loopback, and
reserves one bundle per rank (a GPU each on GPU platforms, a CPU each on CPU)
in a placement group packed onto as few nodes as fit. Each actor holds a
``Worker``; the ranks rendezvous on rank 0's node, so the same code runs on one
machine and on several (every node needs the same pagoda, plugins and model path).

Each step the ``SchedulerOutput`` is put in Ray's object store once and every
actor gets a reference to it; the output rank returns the sampled tokens, the
others ``None``. The executor waits on the ranks one reply at a time, so a rank
that dies or raises (``RayActorError``, ``RayTaskError``) fails the executor at
once instead of leaving the others blocked in a collective; then every actor
is killed and the placement group removed. A local Ray cluster that the
executor started itself is stopped with it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagoda.config import EngineConfig
from pagoda.executor.abstract import Executor, ExecutorFailedError
from pagoda.executor.step_futures import StepQueue
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Seconds to wait for the placement group's resources and for every actor to load its slice.
_STARTUP_TIMEOUT_S = 600.0
_LOOPBACK = "127.0.0.1"


class RayWorkerWrapper:
    """The actor body: one rank's ``Worker``, built inside the actor's process."""

    def __init__(self) -> None:
        self.worker: Any = None

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        from pagoda.distributed import get_open_port

        ip = ray.util.get_node_ip_address()
        if ip == _LOOPBACK:
            return ip, get_open_port()
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, int(s.getsockname()[1])

    def get_node_and_gpu_ids(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def init_worker(self, config: EngineConfig, platform_name: str, rank: int, init_method: str,
                    env: dict[str, str]) -> None:
        from pagoda.worker.process import init_worker_process
        from pagoda.worker.worker import Worker

        os.environ.update(env)
        if init_method.startswith(f"tcp://{_LOOPBACK}:"):
            # gloo picks its interface from the host name otherwise (may be unroutable in a sandbox)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # the engine's decisions, not this process's: its plugins, in-script models and platform
        platform = init_worker_process(config, platform_name)
        worker = Worker(config, platform, rank, init_method, in_engine_process=False)
        worker.init_device()
        worker.load_model()
        self.worker = worker

    def execute_method(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # an exception travels back as a RayTaskError carrying this rank's traceback
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_model(self, scheduler_output: Any) -> Any:
        # the per-step call: Ray resolves the object-store reference before the call
        return self.worker.execute_model(scheduler_output)

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        from pagoda.distributed import destroy_distributed_environment

        destroy_distributed_environment()


def _bundle(platform_device_type: str) -> dict[str, float]:
    """One rank's resources: a GPU on the CUDA / ROCm platforms, a CPU on the CPU platform."""
    if platform_device_type == "cpu":
        return {"CPU": 1.0}
    if platform_device_type == "cuda":
        return {"GPU": 1.0, "CPU": 1.0}
    raise ValueError(f"distributed_executor_backend='ray' runs on the cpu, cuda and rocm platforms, "
                     f"not on device type {platform_device_type!r} yet; use 'mp'")


def _connect(world_size: int) -> bool:
    """Join a Ray cluster, or start a local one on loopback; -> whether this call started it."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("ray executor: joining the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
        return True
    # a private cluster: nothing listens beyond loopback, no dashboard; one logical CPU per rank at least
    num_cpus = max(world_size, os.cpu_count() or 1)
    logger.info("ray executor: starting a local Ray cluster on %s (%d CPUs)", _LOOPBACK, num_cpus)
    ray.init(_node_ip_address=_LOOPBACK, include_dashboard=False, num_cpus=num_cpus,
             logging_level=logging.WARNING)
    return True


class RayDistributedExecutor(Executor):
    backend_name = "ray"

    def _init_executor(self) -> None:
        world_size = self.parallel_config.world_size
        self._failed: str | None = None
        self._closed = False
        self._steps = StepQueue()
        self.workers: list[Any] = []
        self.pg: PlacementGroup | None = None
        self._started_ray = _connect(world_size)
        try:
            self._start_workers(world_size)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, world_size: int) -> None:
        bundle = _bundle(self.platform.device_type)
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=_STARTUP_TIMEOUT_S)
        if not ready:
            raise ExecutorFailedError(
                f"Ray could not reserve {world_size} x {bundle} for the placement group within {_STARTUP_TIMEOUT_S:.0f} s "
                f"(cluster resources: {ray.cluster_resources()})")
        actor_cls = ray.remote(RayWorkerWrapper)
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0), "scheduling_strategy": strategy}
            if "GPU" in bundle:
                options["num_gpus"] = bundle["GPU"]
            self.workers.append(actor_cls.options(**options).remote())  # type: ignore[attr-defined]
        ip, port = self._wait([self.workers[0].get_node_ip_and_free_port.remote()], "start-up", _STARTUP_TIMEOUT_S)[0]
        init_method = f"tcp://{ip}:{port}"
        env = self._device_env()
        self._wait([w.init_worker.remote(self.config, self.platform.name, rank, init_method, env)
                    for rank, w in enumerate(self.workers)], "start-up", _STARTUP_TIMEOUT_S)
        logger.info("ray executor: %d actors, rendezvous %s", world_size, init_method)

    def _device_env(self) -> dict[str, str]:
        """Environment every actor sets before its worker starts.

        A worker picks device ``LOCAL_RANK = rank`` (pagoda.worker.Worker), while Ray shows each GPU
        actor only its own GPU: every actor is shown all the ranks' GPUs, in rank order, as vLLM does.
        That only holds on one node; ranks spread over several GPU nodes are refused, not misplaced.
        """
        if self.platform.device_type == "cpu":
            return {}
        placed = self._wait([w.get_node_and_gpu_ids.remote() for w in self.workers], "start-up", _STARTUP_TIMEOUT_S)
        nodes = {node for node, _ in placed}
        if len(nodes) > 1:
            raise ExecutorFailedError(
                f"the ray executor places the ranks of a {self.platform.name} engine on one node only "
                f"(it got {len(nodes)} nodes): per-node local ranks are not implemented yet")
        devices = [ids[0] for _, ids in placed if ids]
        if len(devices) != len(placed):
            raise ExecutorFailedError(f"Ray gave a rank no device: {placed}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}

    # -- the rpc -----------------------------------------------------------------------
    def _wait(self, refs: list[Any], what: str, timeout: float | None = None) -> list[Any]:
        """Every rank's reply in rank order; the first death or error fails the executor at once."""
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                self._fail(f"ranks {sorted(index[r] for r in pending)} did not answer {what} within {timeout} s")
            ref = done[0]
            try:
                results[index[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._fail(f"worker rank {index[ref]} (a Ray actor) died during {what}: {exc}")
            except ray.exceptions.RayTaskError as exc:
                self._fail(f"worker rank {index[ref]} failed in {what}: {exc}")
        return results

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        # an actor runs its calls in the order sent: the steps in flight finish first anyway
        self._steps.drain()
        self.check_health()
        return self._wait([w.execute_method.remote(method, args, kwargs or {}) for w in self.workers], method)

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._execute_model_non_block(scheduler_output).result()

    def _execute_model_non_block(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Queue the step on every actor and return at once; an actor runs its calls in the order sent,
        so a stage before the last starts the next step while the later stages still run this one."""
        self.check_health()
        # one copy in the object store, a reference to it for every rank
        ref = ray.put(scheduler_output)
        refs = [w.execute_model.remote(ref) for w in self.workers]

        def collect() -> ModelRunnerOutput:
            self._raise_if_failed_or_closed()
            return self._output(self._wait(refs, "execute_model"))

        def ready() -> bool:
            return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

        return self._steps.submit(collect, ready)

    # -- health and shutdown -----------------------------------------------------------
    def check_health(self) -> None:
        self._raise_if_failed_or_closed()

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self.workers and self._failed is None:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except Exception:  # noqa: BLE001 - they are killed next anyway
                pass
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
