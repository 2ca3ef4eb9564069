"""Process groups and collectives for tensor parallelism (vLLM's ``vllm.distributed`` names)."""

from pagoda.distributed.communicator import DeviceCommunicatorBase
from pagoda.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_open_port,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "DeviceCommunicatorBase",
    "GroupCoordinator",
    "destroy_distributed_environment",
    "get_open_port",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
