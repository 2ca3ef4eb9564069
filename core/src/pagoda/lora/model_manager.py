"""The worker's adapters: a host LRU of loaded adapters and the device slots the step reads.

``LoRAModelManager`` wraps every core ``Linear`` of a ``SupportsLoRA`` model with ``LoRASlots``
(before the platform's kernels are bound, so no activation is fused past an adapter). An adapter is
read and checked once (``add_adapter``: PEFT config, each module mapped to a layer and a stacked
projection, shapes) and kept in a host LRU of ``max_cpu_loras``; ``activate`` puts one in one of the
``max_loras`` slots (a free one, else the least recently used one no running row holds), reading it
again from disk if the LRU let it go. ``set_step`` builds the step's token -> slot mapping.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.layers.linear import Linear
from pagoda.distributed.pipeline import is_pp_missing_parameter
from pagoda.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, input_split, output_split
from pagoda.layers.vocab_parallel_embedding import ParallelLMHead
from pagoda.lora.layers import LoRASlots, LoRAStepState
from pagoda.lora.peft import LoRAAdapterError, read_peft_config, read_peft_weights
from pagoda.lora.punica import LoRAKernel, build_step_mapping
from pagoda.lora.request import LoRARequest
from pagoda.models.interface import supports_lora

logger = logging.getLogger(__name__)


@dataclass
class LoRAModel:
    """One adapter read and checked against the model, on the host (vLLM's name)."""

    request: LoRARequest
    rank: int
    scaling: float
    # layer name -> [(stacked projection or None, A [r, in], B [rows, r])]
    layers: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]]


class LoRAModelManager:
    def __init__(self, model: nn.Module, architecture: str, *, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device, kernel: LoRAKernel | None = None) -> None:
        if not supports_lora(model):
            raise ValueError(f"{architecture} does not support LoRA adapters (its model class does not declare "
                             "pagoda.models.interface.SupportsLoRA); run it without enable_lora")
        self.model = model
        self.architecture = architecture
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.state = LoRAStepState() if kernel is None else LoRAStepState(kernel=kernel)
        self.packed = dict(model.packed_modules_mapping)
        self.slots: dict[str, LoRASlots] = {}
        self.layers: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or isinstance(module, ParallelLMHead):
                continue
            widths = (list(module.output_partition_sizes) if isinstance(module, ColumnParallelLinear)
                      else [module.out_features])
            module.lora = LoRASlots(name, module.in_features, widths, max_loras, max_lora_rank, dtype, device,
                                    self.state, checkpoint_shape=_checkpoint_shape(module))
            self.slots[name] = module.lora
            self.layers[name] = module
        if not self.slots:
            raise ValueError(f"{architecture}: no core Linear layers to put LoRA adapters on")
        self.host: OrderedDict[int, LoRAModel] = OrderedDict()
        # slot -> adapter id in it (None: free); id -> slot
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict()

    # -- adapters on the host ------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> LoRAModel:
        """Read and check ``request``'s adapter (LoRAAdapterError naming it and the reason); kept in the LRU."""
        known = self.host.get(request.lora_int_id)
        if known is not None:
            if known.request.lora_name != request.lora_name or known.request.lora_path != request.lora_path:
                raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: lora_int_id={request.lora_int_id} is "
                                       f"already adapter {known.request.lora_name!r} ({known.request.lora_path})")
            self.host.move_to_end(request.lora_int_id)
            return known
        lora = self._read(request)
        self.host[request.lora_int_id] = lora
        while len(self.host) > self.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.debug("LoRA adapter %d left the host cache (max_cpu_loras=%d)", evicted, self.max_cpu_loras)
        return lora

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (runtime unload): host copy and slot. False if it was not loaded."""
        found = self.host.pop(lora_int_id, None) is not None
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
            self._slot_lru.pop(lora_int_id, None)
            for layer in self.slots.values():
                layer.clear_slot(slot)
            found = True
        return found

    def list_adapters(self) -> list[int]:
        return list(self.host)

    def _read(self, request: LoRARequest) -> LoRAModel:
        name = request.lora_name
        config = read_peft_config(name, request.lora_path, self.max_lora_rank)
        weights = read_peft_weights(name, request.lora_path)
        layers: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        problems: list[str] = []
        for module, (a, b) in weights.items():
            if a.shape[0] != config.r:
                problems.append(f"module {module}: rank {a.shape[0]} is not the config's r={config.r}")
                continue
            target = self._target(module)
            if target is None:
                if is_pp_missing_parameter(self.model.map_checkpoint_name(f"{module}.weight"), self.model):  # type: ignore[attr-defined]
                    continue  # another pipeline stage holds this layer (and takes this part of the adapter)
                problems.append(f"module {module} is not a linear layer of {self.architecture} that takes an adapter")
                continue
            layer, index = target
            slots = self.slots[layer]
            reason = slots.check(index, a, b)
            if reason is not None:
                problems.append(reason)
                continue
            for part, part_a, part_b in slots.split_fused(index, a, b):
                part_a, part_b = _rank_factors(self.layers[layer], part, part_a, part_b)
                layers.setdefault(layer, []).append((part, part_a.to(self.dtype), part_b.to(self.dtype)))
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise LoRAAdapterError(f"LoRA adapter {name!r} does not fit the base model {self.architecture}: "
                                   f"{'; '.join(problems[:3])}{more}")
        return LoRAModel(request, config.r, config.scaling, layers)

    def _target(self, module: str) -> tuple[str, int | None] | None:
        """(layer name, stacked projection or None) for an adapter's checkpoint module name."""
        name = self.model.map_checkpoint_name(f"{module}.weight").removesuffix(".weight")  # type: ignore[attr-defined]
        if name in self.slots:
            return name, None
        parent, _, leaf = name.rpartition(".")
        for packed, parts in self.packed.items():
            fused = f"{parent}.{packed}" if parent else packed
            if leaf in parts and fused in self.slots:
                return fused, parts.index(leaf)
        return None

    # -- slots ------------------------------------------------------------------------------------
    def activate(self, request: LoRARequest, pinned: Collection[int]) -> int:
        """The slot holding ``request``'s adapter, loading it into one if needed.

        ``pinned``: adapter ids that running rows read (their slots are not taken). The scheduler
        admits at most ``max_loras`` distinct adapters, so a slot is always free or unpinned.
        """
        lid = request.lora_int_id
        slot = self.slot_of.get(lid)
        if slot is not None:
            self._slot_lru.move_to_end(lid)
            return slot
        lora = self.add_adapter(request)
        slot = self._free_slot(pinned)
        old = self.slot_ids[slot]
        if old is not None:
            del self.slot_of[old]
            self._slot_lru.pop(old, None)
        for layer in self.slots.values():
            layer.clear_slot(slot)
        for layer_name, parts in lora.layers.items():
            for index, a, b in parts:
                self.slots[layer_name].write(slot, index, a, b, lora.scaling)
        self.slot_ids[slot] = lid
        self.slot_of[lid] = slot
        self._slot_lru[lid] = None
        return slot

    def _free_slot(self, pinned: Collection[int]) -> int:
        for slot, lid in enumerate(self.slot_ids):
            if lid is None:
                return slot
        for lid in self._slot_lru:
            if lid not in pinned:
                return self.slot_of[lid]
        raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running requests (max_loras="
                           f"{self.max_loras}); the scheduler admits no more distinct adapters than that")

    def set_step(self, token_slots: np.ndarray | None) -> None:
        """The step's token -> slot index (-1: base model), or None for a step without adapters."""
        if token_slots is None:
            self.state.mapping = None
            return
        self.state.mapping = build_step_mapping(torch.from_numpy(token_slots), self.max_loras, self.device)

    def describe(self) -> str:
        return (f"LoRA: {len(self.slots)} layers wrapped, {self.max_loras} slot(s) of rank {self.max_lora_rank}, "
                f"host cache of {self.max_cpu_loras}, {self.dtype}, kernel {self.state.kernel.name}")


def _checkpoint_shape(layer: Linear) -> tuple[int, list[int]]:
    """(inputs, stacked output widths) of ``layer`` as the checkpoint (and so an adapter) has it: every
    tensor-parallel rank's part together."""
    if isinstance(layer, ColumnParallelLinear):
        return layer.in_features, list(layer.output_sizes)
    if isinstance(layer, RowParallelLinear):
        return layer.input_size, [layer.out_features]
    return layer.in_features, [layer.out_features]


def _rank_factors(layer: Linear, index: int | None, a: torch.Tensor,
                  b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of projection ``index``'s factors, split as the layer's weight is.

    A column-split layer keeps its rows of B (the rows of its weight, KV heads shared by several ranks
    included). A row-split layer keeps its columns of A: each rank adds ``(x_r A_r^T) B^T`` to its partial
    sum before the layer's all-reduce, and those sum to ``(x A^T) B^T``, so no extra communication.
    """
    if output_split(layer):
        assert isinstance(layer, ColumnParallelLinear)
        _, rows, start = layer.shard_range(index or 0)
        return a, b.narrow(0, start, rows)
    if input_split(layer):
        assert isinstance(layer, RowParallelLinear)
        return a.narrow(1, layer.tp_rank * layer.in_features, layer.in_features), b
    return a, b


def lora_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``lora_dtype`` as a torch dtype (auto = the model's)."""
    table: dict[str, Any] = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                             "float16": torch.float16, "half": torch.float16}
    return model_dtype if name == "auto" else table[name]
