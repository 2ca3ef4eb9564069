"""``distributed_executor_backend='external_launcher'``: ranks started by torchrun, one whole engine each.

vLLM's offline SPMD mode: ``torchrun --nproc-per-node N script.py`` runs the same script N times; every
process builds its own ``LLM`` (scheduler, KV cache manager, front end) and its own rank's worker in
that process, joining the group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK``). The engines stay in step because they receive the same requests in the
same order and schedule deterministically; every tensor-parallel rank samples the same tokens (same
seeds, all-gathered logits), so each engine reads its own worker's result. Pipeline parallelism is not
offered here: only the last stage holds logits (logprobs would differ between the engines).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pagoda.executor.abstract import ExecutorFailedError
from pagoda.executor.uniproc_executor import UniProcExecutor
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import MemoryReport
from pagoda.worker.worker import Worker


class ExecutorWithExternalLauncher(UniProcExecutor):
    backend_name = "external_launcher"

    def _init_executor(self) -> None:
        parallel = self.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("distributed_executor_backend='external_launcher' runs tensor parallelism only "
                             "(pipeline_parallel_size must be 1); use 'mp' for pipeline parallelism")
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' expects torchrun's environment "
                             f"({', '.join(missing)} unset): start the script with torchrun --nproc-per-node N")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != parallel.world_size:
            raise ValueError(f"torchrun started {world} processes; tensor_parallel_size x pipeline_parallel_size "
                             f"is {parallel.world_size}")
        # every process is an engine of its own: each worker shares its engine's process
        self.driver_worker = Worker(self.config, self.platform, rank=rank, distributed_init_method="env://",
                                    in_engine_process=True)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def initialize_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int) -> MemoryReport:
        report: MemoryReport = self.driver_worker.init_kv_cache(max_num_seqs, max_num_batched_tokens)
        # one block id must name a block in every rank's cache: all engines take the smallest count
        fewest = torch.tensor([report.num_blocks], dtype=torch.int64)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        if int(fewest) != report.num_blocks:
            report = self.driver_worker.init_kv_cache(max_num_seqs, max_num_batched_tokens, int(fewest))
        return report

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.driver_worker.runner.execute_model(scheduler_output)
        if out is None:
            raise ExecutorFailedError("the worker returned no step result")
        return out

    def shutdown(self) -> None:
        from pagoda.distributed import destroy_distributed_environment

        destroy_distributed_environment()
