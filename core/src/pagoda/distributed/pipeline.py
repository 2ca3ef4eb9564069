"""Pipeline-parallel pieces model code uses (vLLM's names): which layers a stage holds, what passes between stages.

A family supports pipeline parallelism (``pagoda.models.interface.SupportsPP`` on the model class, vLLM's name)
by building its decoder layers with ``make_layers``, its embedding only on the first stage and its final
norm and LM head only on the last (``PPMissingLayer`` elsewhere), taking ``intermediate_tensors`` in
``forward`` on every stage but the first and returning ``IntermediateTensors`` on every stage but the last.
The runner sends and receives them; the weights loader skips what ``is_pp_missing_parameter`` says this
stage does not hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_pp_group


class IntermediateTensors(dict[str, torch.Tensor]):
    """Named activations one stage hands the next (e.g. ``hidden_states`` and ``residual``), each [T, ...]."""


class PPMissingLayer(nn.Identity):
    """Stands where a layer lives on another pipeline stage (no parameters, never called)."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this layer lives on another pipeline stage")


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage ``pp_rank`` holds: even shares, the remainder to the stages
    before the last (which also holds the final norm and the LM head) — vLLM's split."""
    if num_hidden_layers < pp_size:
        raise ValueError(f"{num_hidden_layers} layers cannot fill pipeline_parallel_size={pp_size} stages")
    partitions = [num_hidden_layers // pp_size] * pp_size
    for i in range(2, num_hidden_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def make_layers(num_hidden_layers: int, layer_fn: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """This stage's (start, end, layers): ``layer_fn(i)`` for its layers, ``PPMissingLayer`` for the others,
    so layer ``i`` keeps its index (and its checkpoint name) on every stage."""
    pp = get_pp_group()
    start, end = get_pp_indices(num_hidden_layers, pp.rank_in_group, pp.world_size)
    layers = nn.ModuleList(layer_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_hidden_layers))
    return start, end, layers


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint name ``name`` belongs to a module this stage does not hold."""
    parts = name.split(".")
    module: nn.Module = model
    for part in parts[:-1]:
        child = module._modules.get(part)
        if child is None:
            return False
        if isinstance(child, PPMissingLayer):
            return True
        module = child
    return False
