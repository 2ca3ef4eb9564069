"""One rank: its device, its slice of the model and its KV cache, and the steps it runs.

An executor (``pagoda.executor``) owns one ``Worker`` per rank, in the engine's
process (``uni``) or each in its own process (``mp``). The scheduler and the KV
cache manager stay with the engine; a worker only receives each step's
``SchedulerOutput`` (new requests in full, diffs for the others) and the output
rank returns the sampled tokens.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from collections import deque

from pagoda.config import EngineConfig
from pagoda.distributed import get_pp_group, get_tp_group, init_distributed_environment
from pagoda.distributed.communicator import CommStats, DeviceCommunicatorBase
from pagoda.platforms import Platform
from pagoda.plugins.specs import import_object
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import MemoryReport, ModelRunner

logger = logging.getLogger(__name__)

# steps whose times a worker keeps (a few minutes of decode steps)
_STEP_TIMES_KEPT = 4096


class Worker:
    def __init__(self, config: EngineConfig, platform: Platform, rank: int = 0,
                 distributed_init_method: str | None = None, *, in_engine_process: bool = True) -> None:
        self.config = config
        self.platform = platform
        self.rank = rank
        self.world_size = config.parallel_config.world_size
        self.distributed_init_method = distributed_init_method
        # In the engine's process the scheduler appends each sampled token to the request's output
        # list, which the runner's sampler holds by reference (penalties read it). A worker in its
        # own process holds a copy and appends the tokens itself.
        self.in_engine_process = in_engine_process
        self.model_runner: ModelRunner | None = None
        # (start, end) of this rank's recent non-empty steps, CLOCK_MONOTONIC (one clock for every process
        # on a machine): whether and how much pipeline stages overlap (tests, benchmarks)
        self.step_times: deque[tuple[float, float]] = deque(maxlen=_STEP_TIMES_KEPT)

    @property
    def is_output_rank(self) -> bool:
        """The rank whose step results go back to the engine: the last pipeline stage's first
        tensor-parallel rank (every rank of that stage samples the same tokens)."""
        return self.rank == self.world_size - self.config.parallel_config.tensor_parallel_size

    def init_device(self) -> None:
        if self.world_size > 1 and not self.in_engine_process:
            # the platform picks this rank's device by it (torchrun's variable; one machine: rank = local rank)
            os.environ["LOCAL_RANK"] = str(self.rank)
        self.platform.init_worker(self.config)
        self.platform.seed_everything(self.config.model.seed)
        if self.world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("a worker of a multi-rank layout needs a distributed_init_method")
            cls = self.communicator_cls()
            init_distributed_environment(self.world_size, self.rank, self.distributed_init_method, cls,
                                         self.platform.device(), self.config.parallel_config.tensor_parallel_size,
                                         self.config.parallel_config.pipeline_parallel_size)

    def communicator_cls(self) -> type[DeviceCommunicatorBase]:
        ref = self.platform.get_device_communicator_cls()
        cls = import_object(ref) if isinstance(ref, str) else ref
        if not (isinstance(cls, type) and issubclass(cls, DeviceCommunicatorBase)):
            raise TypeError(f"platform {self.platform.name!r} names communicator {ref!r}, which is no DeviceCommunicatorBase")
        return cls

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config, self.platform)
        self.model_runner.load_model()

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the worker has not loaded its model yet")
        return self.model_runner

    def init_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int | None = None) -> MemoryReport:
        return self.runner.init_kv_cache(max_num_seqs, max_num_batched_tokens, num_blocks)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.runner.supported_tasks()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        start = time.monotonic()
        out = self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens:
            self.step_times.append((start, time.monotonic()))
        if not self.in_engine_process:
            self._append_own_outputs(scheduler_output, out)
        return out if self.is_output_rank else None

    def _append_own_outputs(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        rows = self.runner.batch.rows
        for diff in so.scheduled_cached_reqs:
            if diff.new_token_ids and diff.req_id in rows:
                rows[diff.req_id].output_token_ids.extend(diff.new_token_ids)
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            if tokens:
                rows[rid].output_token_ids.extend(tokens)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def set_cpu_share(self, cpus: list[int]) -> dict[str, Any]:
        """This rank's slice of the engine's ``cpus`` (ranks of one engine split them as init_worker does)."""
        from pagoda.worker.cpu_share import split_cpus

        mine = split_cpus(cpus, self.world_size)[self.rank]
        return self.platform.set_cpu_share(mine, self.config).model_dump()

    def wake_up(self) -> None:
        self.runner.wake_up()

    # -- LoRA adapters (enable_lora; vLLM's worker names) -------------------------------------
    def add_lora(self, lora_request: Any) -> tuple[bool, str] | None:
        """Read and check an adapter into the host cache; its refusal as (not found?, message); None: loaded.

        A bad adapter is the caller's error, not the worker's: it comes back as data, so the executor
        (which marks itself failed on any raise) keeps serving.
        """
        from pagoda.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError

        try:
            self.runner.lora.add_adapter(lora_request)
        except LoRAAdapterError as e:
            return isinstance(e, LoRAAdapterNotFoundError), str(e)
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.lora.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.runner.lora.list_adapters()

    def get_step_times(self, reset: bool = True) -> list[tuple[float, float]]:
        """This rank's (start, end) monotonic times of its recent steps, oldest first."""
        times = list(self.step_times)
        if reset:
            self.step_times.clear()
        return times

    def get_comm_stats(self, reset: bool = True) -> dict[str, float]:
        """Seconds and calls this rank spent in tensor- and pipeline-parallel communication (benchmarks read it)."""
        out = {"seconds": 0.0, "calls": 0}
        for group in (get_tp_group(), get_pp_group()):
            comm = group.communicator
            if comm is None:
                continue
            out["seconds"] += comm.stats.seconds
            out["calls"] += comm.stats.calls
            if reset:
                comm.stats = CommStats()
        return out
