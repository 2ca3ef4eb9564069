"""The CPU platform's collectives: shared memory among the ranks of one host, torch.distributed on gloo otherwise.

All-reduce (float32 / bfloat16 / float16) and all-gather go through a shared-memory segment when every
rank of the group runs on this host (``pagoda_platform_cpu.shm_all_reduce``); other dtypes, send/recv
and broadcast, and every collective of a group spread over hosts or with ``PAGODA_CPU_SHM_ALLREDUCE=0``
use core's gloo implementation.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import torch
import torch.distributed as dist

from pagoda.distributed.communicator import DeviceCommunicatorBase
from pagoda_platform_cpu.shm_all_reduce import DEFAULT_SLOT_BYTES, DTYPE_CODES, ShmSegment, open_shm_segment

logger = logging.getLogger(__name__)


class CpuCommunicator(DeviceCommunicatorBase):
    # gloo: the torch.distributed backend that runs on host memory everywhere torch does
    backend: ClassVar[str] = "gloo"

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], device: torch.device,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, initial_seq: int = 0) -> None:
        super().__init__(group, ranks, device)
        # collective: every rank of the group constructs its communicator at the same point
        self.shm: ShmSegment | None
        self.shm, self.transport = open_shm_segment(group, ranks, self.rank_in_group, slot_bytes, initial_seq)
        logger.info("group %s: all-reduce / all-gather over %s", ranks,
                    self.transport if self.shm is not None else f"gloo ({self.transport})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is None or x.dtype not in DTYPE_CODES:
            return super().all_reduce(x)
        t0 = time.perf_counter()
        self.shm.all_reduce(x)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return x

    def _all_gather_dim0(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is None:
            return super()._all_gather_dim0(x)
        t0 = time.perf_counter()
        out = self.shm.all_gather(x)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return out

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
