"""Tensor-parallel linear layers (vLLM's names), built on core's ``Linear``.

Each layer holds only this rank's slice of the weight and loads it from the
whole checkpoint tensor through ``weight_loader(param, loaded_weight, shard_id)``
(the same hook a quantization method's parameters use), so a model family's
loader stays rank-agnostic. With one rank (``get_tensor_model_parallel_world_size() == 1``)
every class here is exactly ``Linear``: same shapes, same forward.

* ``ColumnParallelLinear``: output features split; each rank computes its slice (no communication).
* ``MergedColumnParallelLinear``: several projections stacked on the output dim (gate/up), each split.
* ``QKVParallelLinear``: q, k, v stacked; query heads split, KV heads split or, with fewer KV heads
  than ranks, replicated (rank r holds KV head ``r // (ranks / kv_heads)``).
* ``RowParallelLinear``: input features split; partial products summed with one all-reduce, then the bias.
* ``ReplicatedLinear``: the whole weight on every rank (small projections, routers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.linear import Linear


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _check_shape(param: torch.Tensor, shard: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(shard.shape):
        raise ValueError(f"checkpoint tensor for {what} gives this rank shape {tuple(shard.shape)}, "
                         f"the layer holds {tuple(param.shape)}")


def _attach_loaders(layer: Linear) -> None:
    layer.weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    if layer.bias is not None:
        layer.bias.weight_loader = layer.weight_loader  # type: ignore[attr-defined]


class ReplicatedLinear(Linear):
    """The whole layer on every rank (marks a ``Linear`` as deliberately not split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        _attach_loaders(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        _check_shape(param, loaded_weight, type(self).__name__)
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(Linear):
    """``y = x W^T + b`` with W's rows (output features) split across ranks; ``gather_output`` all-gathers y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 *, gather_output: bool = False, output_sizes: list[int] | None = None,
                 output_partition_sizes: list[int] | None = None) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        # the stacked projections' widths in the checkpoint (one entry for a plain layer) and on this rank
        self.output_sizes = list(output_sizes or [out_features])
        self.output_partition_sizes = output_partition_sizes or [
            divide(n, self.tp_size, "output features") for n in self.output_sizes]
        super().__init__(in_features, sum(self.output_partition_sizes), bias, dtype)
        self.gather_output = gather_output
        _attach_loaders(self)

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's param, rows, first checkpoint row of this rank) for stacked projection ``shard_id``."""
        size = self.output_partition_sizes[shard_id]
        return sum(self.output_partition_sizes[:shard_id]), size, self.tp_rank * size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None and len(self.output_sizes) > 1:
            # the checkpoint stores the projections already stacked (Phi-3's gate_up_proj)
            if loaded_weight.shape[0] != sum(self.output_sizes):
                raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, {type(self).__name__} "
                                 f"expects {sum(self.output_sizes)} rows")
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        offset, size, start = self.shard_range(shard_id or 0)
        if loaded_weight.shape[0] != self.output_sizes[shard_id or 0]:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, {type(self).__name__} "
                             f"expects {self.output_sizes[shard_id or 0]} rows")
        target = param.data.narrow(0, offset, size)
        shard = loaded_weight.narrow(0, start, size)
        _check_shape(target, shard, type(self).__name__)
        target.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.gather_output and self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections of one input stacked on the output dim (gate and up), each split across ranks.

    Rank r holds ``[gate_r; up_r]``, so the gated activation still finds its two halves side by side.
    ``activation="silu_and_mul"`` (beyond vLLM): the layer returns ``silu(gate) * up`` itself, fused
    into the matmul where the platform's kernel can (``SiluAndMulLinearKernel``), else through the
    platform's ``silu_and_mul``: one call where a model wrote ``SiluAndMul()(gate_up_proj(x))``.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 *, activation: str | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, dtype, output_sizes=output_sizes)
        if activation is not None:
            if activation != "silu_and_mul" or len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]:
                raise ValueError(f"activation: only 'silu_and_mul' of two equal projections (gate, up), got "
                                 f"{activation!r} of {output_sizes}")
            self.act = SiluAndMul()


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of ``hidden_size`` inputs in one matmul; heads split across ranks.

    ``num_heads`` / ``num_kv_heads`` are this rank's; ``num_kv_head_replicas`` ranks share a KV head
    when there are fewer KV heads than ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, dtype: torch.dtype) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:
            if tp % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={total_num_kv_heads}")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        q, kv = self.num_heads * head_size, self.num_kv_heads * head_size
        total_kv = total_num_kv_heads * head_size
        # checkpoint widths: the whole q, k, v; this rank's rows: q, kv, kv
        super().__init__(hidden_size, (total_num_heads * head_size + 2 * total_kv), bias, dtype,
                         output_sizes=[total_num_heads * head_size, total_kv, total_kv],
                         output_partition_sizes=[q, kv, kv])

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == 0:
            return 0, q, self.tp_rank * q
        # ranks sharing a KV head read the same rows
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        return q + (shard_id - 1) * kv, kv, kv_rank * kv


class RowParallelLinear(Linear):
    """``y = x W^T + b`` with W's columns (input features) split: each rank's partial sum, all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 *, reduce_results: bool = True) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.input_size = in_features
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias, dtype)
        self.reduce_results = reduce_results
        _attach_loaders(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 1:  # the bias: whole on every rank, added once after the reduction
            _check_shape(param, loaded_weight, f"{type(self).__name__} bias")
            param.data.copy_(loaded_weight)
            return
        if loaded_weight.shape[1] != self.input_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"{type(self).__name__} expects {self.input_size} input columns")
        size = self.in_features
        shard = loaded_weight.narrow(1, self.tp_rank * size, size)
        _check_shape(param, shard, type(self).__name__)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        # the bias joins after the sum, or every rank would add it once
        if self.quant_method is not None:  # this rank's slice of the quantized weight times its slice of x
            y = self.quant_method.apply(self, x, None)
        elif self.kernel is None:
            y = F.linear(x, self.weight)
        else:
            y = self.kernel.apply(x, self.prepared, None)
        if self.lora is not None:  # this rank.s columns of A: the partial sums add up to the whole adapter
            y = self.lora(x, y)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def output_split(layer: nn.Module) -> bool:
    """Whether ``layer`` holds only its rank's output features (a column-parallel layer over several ranks)."""
    return isinstance(layer, ColumnParallelLinear) and layer.tp_size > 1


def input_split(layer: nn.Module) -> bool:
    """Whether ``layer`` holds only its rank's input features (a row-parallel layer over several ranks)."""
    return isinstance(layer, RowParallelLinear) and layer.tp_size > 1


def check_input_split(layer: nn.Module, unit: int, what: str) -> None:
    """ValueError unless this rank's input features fall on whole ``unit``-feature blocks of the checkpoint
    (a quantization method's packed rows or groups), which it cannot slice inside."""
    if not input_split(layer):
        return
    assert isinstance(layer, RowParallelLinear)
    if layer.in_features % unit:
        raise ValueError(
            f"{what}: tensor_parallel_size={layer.tp_size} gives each rank {layer.in_features} of the layer's "
            f"{layer.input_size} input features, not a multiple of the checkpoint's {unit}; the input size is not "
            "aligned with the quantized weight shape (use a smaller tensor_parallel_size)")


def shard_input(layer: nn.Module, loaded: torch.Tensor, *, dim: int, unit: int = 1, what: str) -> torch.Tensor:
    """This rank's input features of a quantization method's checkpoint tensor for ``layer``.

    ``dim``: the tensor's input-feature dim; ``unit``: input features per element along it (GPTQ's
    qweight rows pack 8; a row of group scales covers ``group_size``). A row-parallel layer over several
    ranks takes its slice (``check_input_split`` refuses a slice inside a block); any other layer keeps it whole.
    """
    if not input_split(layer):
        return loaded
    assert isinstance(layer, RowParallelLinear)
    check_input_split(layer, unit, what)
    if loaded.shape[dim] * unit != layer.input_size:
        raise ValueError(f"{what}: checkpoint tensor of shape {tuple(loaded.shape)} covers {loaded.shape[dim] * unit} "
                         f"input features along dim {dim}, the layer has {layer.input_size}")
    rows = layer.in_features // unit
    # a copy: a view would keep the whole checkpoint tensor alive on every rank
    return loaded.narrow(dim, layer.tp_rank * rows, rows).clone()


def shard_output(layer: nn.Module, loaded: torch.Tensor, shard_id: int | None, *, dim: int, pack_factor: int = 1,
                 what: str) -> torch.Tensor:
    """This rank's output features of a quantization method's checkpoint tensor for ``layer``.

    Sliced as the layer slices its float weight (stacked projection ``shard_id``; a checkpoint tensor
    holding them all, ``shard_id`` None, is split into the projections first); ``pack_factor``: output
    features per element along ``dim`` (int4 zeros packed eight to an int32). Any layer that is not
    column-parallel over several ranks keeps the tensor whole.
    """
    if not output_split(layer):
        return loaded
    assert isinstance(layer, ColumnParallelLinear)
    if hasattr(layer, "org_vocab_size"):
        # a vocab-parallel LM head pads the vocabulary to the ranks: packed rows would straddle the padding
        raise ValueError(f"{what}: a quantized LM head is not split across tensor-parallel ranks "
                         f"(tensor_parallel_size={layer.tp_size}); keep the LM head unquantized")
    if shard_id is None and len(layer.output_sizes) > 1:
        if any(n % pack_factor for n in layer.output_sizes):
            raise ValueError(f"{what}: projections of {layer.output_sizes} output features do not fall on the "
                             f"checkpoint's packing of {pack_factor}")
        parts = loaded.split([n // pack_factor for n in layer.output_sizes], dim)
        return torch.cat([shard_output(layer, part, i, dim=dim, pack_factor=pack_factor, what=what)
                          for i, part in enumerate(parts)], dim)
    index = shard_id or 0
    _, size, start = layer.shard_range(index)
    if size % pack_factor or start % pack_factor:
        raise ValueError(f"{what}: tensor_parallel_size={layer.tp_size} gives this rank output features "
                         f"{start}..{start + size} of {layer.output_sizes[index]}, not on the checkpoint's packing "
                         f"of {pack_factor} (use a smaller tensor_parallel_size)")
    if loaded.shape[dim] * pack_factor != layer.output_sizes[index]:
        raise ValueError(f"{what}: checkpoint tensor of shape {tuple(loaded.shape)} covers "
                         f"{loaded.shape[dim] * pack_factor} output features along dim {dim}, projection {index} "
                         f"of the layer has {layer.output_sizes[index]}")
    return loaded.narrow(dim, start // pack_factor, size // pack_factor).clone()


def check_tensor_parallel_support(model: nn.Module, architecture: str) -> None:
    """Refuse a model that would not be split across the ranks (before its weights load).

    Every ``Linear`` and ``Embedding`` of a tensor-parallel model must be one of the parallel
    layers (or ``ReplicatedLinear``, replicated on purpose): a plain one would hold and compute the
    whole layer on every rank, which runs but gains nothing from the ranks it occupies.
    """
    if get_tensor_model_parallel_world_size() == 1:
        return
    from pagoda.layers.embedding import Embedding
    from pagoda.layers.vocab_parallel_embedding import VocabParallelEmbedding

    parallel = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, VocabParallelEmbedding)
    # core's plain layers, their subclasses, and torch's own (a model built from transformers' modules)
    unsplit = (Linear, Embedding, nn.Linear, nn.Embedding)
    plain = [name for name, m in model.named_modules() if isinstance(m, unsplit) and not isinstance(m, parallel)]
    if plain:
        more = f" and {len(plain) - 4} more" if len(plain) > 4 else ""
        raise ValueError(
            f"{architecture} does not support tensor parallelism: its layers {', '.join(plain[:4])}{more} are "
            "plain Linear / Embedding layers, not core's parallel ones (ColumnParallelLinear, RowParallelLinear, "
            "QKVParallelLinear, VocabParallelEmbedding, ...); run it with tensor_parallel_size=1")
