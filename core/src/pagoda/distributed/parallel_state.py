"""Which rank this process is, and the groups it talks in (vLLM's ``parallel_state`` names).

With one rank nothing here is initialised: ``get_tensor_model_parallel_world_size()``
is 1 and the parallel layers behave as plain ones, so the in-process (``uni``)
path never touches ``torch.distributed``.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.distributed.communicator import DeviceCommunicatorBase

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One group of ranks and its communicator (None where the group has one rank)."""

    ranks: list[int]
    rank_in_group: int
    communicator: DeviceCommunicatorBase | None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicator is None:
            return x
        return self.communicator.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.communicator is None:
            return x
        return self.communicator.all_gather(x, dim)


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0, communicator=None)
_TP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def get_open_port() -> int:
    """A free TCP port on loopback for the process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, communicator_cls: type[DeviceCommunicatorBase],
    device: torch.device, tensor_parallel_size: int,
) -> None:
    """Join the process group and build this rank's tensor-parallel group."""
    global _TP
    if world_size == 1:
        _TP = _SINGLE
        return
    if not dist.is_initialized():
        dist.init_process_group(backend=communicator_cls.backend, init_method=init_method,
                                world_size=world_size, rank=rank)
    if world_size != tensor_parallel_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size {tensor_parallel_size}: "
                         "only tensor parallelism is implemented")
    ranks = list(range(world_size))
    # every rank must call new_group for every group, in the same order
    group = dist.new_group(ranks, backend=communicator_cls.backend)
    _TP = GroupCoordinator(ranks, ranks.index(rank), communicator_cls(group, ranks, device))
    logger.info("rank %d/%d: tensor-parallel group %s on %s", rank, world_size, ranks, communicator_cls.backend)


def destroy_distributed_environment() -> None:
    global _TP
    if _TP.communicator is not None:
        _TP.communicator.destroy()
    _TP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()
