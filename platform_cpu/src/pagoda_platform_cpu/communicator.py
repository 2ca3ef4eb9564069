"""The CPU platform's collectives: torch.distributed on gloo (core's implementation, gloo's backend)."""

from __future__ import annotations

from typing import ClassVar

from pagoda.distributed.communicator import DeviceCommunicatorBase


class CpuCommunicator(DeviceCommunicatorBase):
    # gloo: the torch.distributed backend that runs on host memory everywhere torch does
    backend: ClassVar[str] = "gloo"
