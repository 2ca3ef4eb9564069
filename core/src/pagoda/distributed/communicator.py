"""The collectives tensor- and pipeline-parallel layers call, over a process group the platform chooses.

A platform plugin names its communicator (``Platform.get_device_communicator_cls``):
the CPU platform's runs on gloo, the CUDA one's on NCCL. The base class here
implements every collective with ``torch.distributed`` on the group it is given,
so a platform subclass only names its ``backend`` and overrides what it can do
faster (vLLM's ``DeviceCommunicatorBase`` plays the same role).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Wall time this rank spent inside collectives (waiting for the slowest peer included)."""

    seconds: float = 0.0
    calls: int = 0


class DeviceCommunicatorBase:
    """Collectives among the ranks of one group (a tensor-parallel group, a pipeline pair)."""

    # the torch.distributed backend the process groups of this platform are created with
    backend: ClassVar[str] = "gloo"

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], device: torch.device) -> None:
        self.group = group
        # global ranks of the group's members, in group-rank order
        self.ranks = ranks
        self.device = device
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank())
        # two clock reads per collective (~0.1 us) against tens of microseconds for the call itself
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``x``."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        if dim < 0:
            dim += x.dim()
        x = x.contiguous()
        # gathered along dim 0 ([world * d0, ...], as gloo and NCCL both take it), then moved to ``dim``
        out = self._all_gather_dim0(x)
        if dim == 0:
            return out
        out = out.view(self.world_size, *x.shape).movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:])

    def _all_gather_dim0(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's contiguous ``x`` stacked along dim 0: [world * d0, ...] (a platform may override the transport)."""
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        t0 = time.perf_counter()
        dist.all_gather_single(out, x, group=self.group)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send to group rank ``dst``."""
        t0 = time.perf_counter()
        dist.send(x.contiguous(), self.ranks[dst], group=self.group)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of known shape and dtype from group rank ``src``."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        t0 = time.perf_counter()
        dist.recv(out, self.ranks[src], group=self.group)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Group rank ``src``'s ``x`` into ``x`` on every rank, in place."""
        t0 = time.perf_counter()
        dist.broadcast(x, self.ranks[src], group=self.group)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        return x

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Release what the communicator holds beside the group (the group itself is torch's)."""
