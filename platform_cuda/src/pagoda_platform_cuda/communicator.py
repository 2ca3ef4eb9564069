"""The CUDA platform's collectives: torch.distributed on NCCL (never run on a GPU by pagoda's tests)."""

from __future__ import annotations

from typing import ClassVar

from pagoda.distributed.communicator import DeviceCommunicatorBase


class CudaCommunicator(DeviceCommunicatorBase):
    backend: ClassVar[str] = "nccl"
