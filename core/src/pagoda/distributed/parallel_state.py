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

    # -- pipeline stages (a pipeline group lists one rank per stage, in stage order) ----------
    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def _comm(self) -> DeviceCommunicatorBase:
        if self.communicator is None:
            raise RuntimeError("a one-rank group has no peer to talk to")
        return self.communicator

    def send_next(self, x: torch.Tensor) -> None:
        self._comm().send(x, self.rank_in_group + 1)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._comm().recv(shape, dtype, self.rank_in_group - 1)

    def broadcast_from_last(self, x: torch.Tensor) -> torch.Tensor:
        """The last rank's ``x`` on every rank (the others pass a tensor of the same shape and dtype)."""
        if self.communicator is None:
            return x
        return self.communicator.broadcast(x, self.world_size - 1)


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0, communicator=None)
_TP: GroupCoordinator = _SINGLE
_PP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


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
    device: torch.device, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
) -> None:
    """Join the process group and build this rank's tensor- and pipeline-parallel groups.

    vLLM's layout: rank = stage * tensor_parallel_size + tp_rank, so a stage's ranks are consecutive
    and a pipeline group holds the ranks with the same tp_rank, one per stage.
    """
    global _TP, _PP
    if world_size == 1:
        _TP = _PP = _SINGLE
        return
    if world_size != tensor_parallel_size * pipeline_parallel_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size {tensor_parallel_size} x "
                         f"pipeline_parallel_size {pipeline_parallel_size}")
    if not dist.is_initialized():
        dist.init_process_group(backend=communicator_cls.backend, init_method=init_method,
                                world_size=world_size, rank=rank)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    tp_groups = [[stage * tp + i for i in range(tp)] for stage in range(pp)]
    pp_groups = [[stage * tp + i for stage in range(pp)] for i in range(tp)]
    # every rank must call new_group for every group, in the same order
    for kind, groups in (("tp", tp_groups), ("pp", pp_groups)):
        for ranks in groups:
            group = dist.new_group(ranks, backend=communicator_cls.backend)
            if rank not in ranks:
                continue
            coordinator = GroupCoordinator(ranks, ranks.index(rank),
                                           communicator_cls(group, ranks, device) if len(ranks) > 1 else None)
            if kind == "tp":
                _TP = coordinator
            else:
                _PP = coordinator
    logger.info("rank %d/%d: tensor-parallel group %s, pipeline group %s on %s", rank, world_size,
                _TP.ranks, _PP.ranks, communicator_cls.backend)


def destroy_distributed_environment() -> None:
    global _TP, _PP
    for group in (_TP, _PP):
        if group.communicator is not None:
            group.communicator.destroy()
    _TP = _PP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()
