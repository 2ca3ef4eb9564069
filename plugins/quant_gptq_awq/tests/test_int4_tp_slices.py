"""The GPTQ / AWQ method's tensor-parallel slicing in one process: each of two ranks (the rank patched in
``pagoda.layers.parallel_linear``) builds a parallel layer, loads the whole checkpoint tensors through the
parameters' ``weight_loader`` and computes its part; the parts must give the one-rank layer's output
(row-parallel: summed; column-parallel: each rank's rows of the stacked projections). Splits inside an
int32 pack or a group are refused by name, before any weight is read where the shapes already say so."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from int4_checkpoints import awq_tensors, gptq_tensors, quantize

import pagoda.layers.parallel_linear as parallel_linear
from pagoda.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from pagoda_quant_gptq_awq.linear import Int4LinearMethod


def _at_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setattr(parallel_linear, "get_tensor_model_parallel_world_size", lambda: world)
    monkeypatch.setattr(parallel_linear, "get_tensor_model_parallel_rank", lambda: rank)


def _checkpoint(fmt: str, n: int, k: int, group_size: int, act_order: bool, seed: int, bits: int = 4,
                sorted_groups: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int64)
        order = torch.arange(k) if sorted_groups else torch.randperm(k, generator=gen)
        g_idx[order] = torch.arange(k) // group_size
    qz = quantize(weight, group_size, g_idx, min_zero=1 if fmt == "gptq" else 0, bits=bits)
    return gptq_tensors(qz, bits) if fmt == "gptq" else awq_tensors(qz)


def _load(layer: Any, method: Int4LinearMethod, parts: list[dict[str, torch.Tensor]]) -> None:
    method.create_weights(layer, layer.in_features, list(getattr(layer, "output_partition_sizes", [layer.out_features])),
                          getattr(layer, "input_size", layer.in_features), layer.out_features, torch.float32)
    layer.quant_method = method
    for shard_id, tensors in enumerate(parts):
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard_id if len(parts) > 1 else None)
    method.process_weights_after_loading(layer)


# (format, group_size, act order, bits, act-order groups in input order: each rank then holds only its half
# of the groups, the other half's left empty in its kernel)
CASES = [("gptq", 32, False, 4, False), ("gptq", 16, True, 4, False), ("gptq", 16, True, 4, True),
         ("gptq", -1, False, 4, False), ("gptq", 32, False, 8, False), ("gptq", 16, True, 8, True),
         ("awq", 32, False, 4, False), ("awq", -1, False, 4, False)]


@pytest.mark.parametrize("fmt,group_size,act_order,bits,sorted_groups", CASES,
                         ids=[f"{f}{b}-g{g}{'-act' if a else ''}{'-sorted' if o else ''}" for f, g, a, b, o in CASES])
def test_row_parallel_ranks_sum_to_the_whole_layer(monkeypatch: pytest.MonkeyPatch, fmt: str, group_size: int,
                                                   act_order: bool, bits: int, sorted_groups: bool) -> None:
    n, k = 48, 128
    tensors = _checkpoint(fmt, n, k, group_size if group_size != -1 else k, act_order, seed=1, bits=bits,
                          sorted_groups=sorted_groups)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    _at_rank(monkeypatch, 0, 1)
    whole = RowParallelLinear(k, n, bias=False, dtype=torch.float32)
    _load(whole, Int4LinearMethod(fmt, group_size, 1 if fmt == "gptq" else 0, bits, act_order), [tensors])
    expected = whole.quant_method.apply(whole, x)
    total = torch.zeros_like(expected)
    for rank in range(2):
        _at_rank(monkeypatch, rank, 2)
        layer = RowParallelLinear(k, n, bias=False, dtype=torch.float32)
        method = Int4LinearMethod(fmt, group_size, 1 if fmt == "gptq" else 0, bits, act_order)
        _load(layer, method, [tensors])
        held = method.parts[0][1]
        assert held.out_features == n and method.in_features == k // 2
        total += method.apply(layer, x[:, rank * (k // 2):(rank + 1) * (k // 2)])
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_merged_column_parallel_ranks_hold_their_rows_of_each_projection(monkeypatch: pytest.MonkeyPatch,
                                                                        fmt: str) -> None:
    k, sizes = 64, [32, 48]
    parts = [_checkpoint(fmt, n, k, 32, False, seed=3 + i) for i, n in enumerate(sizes)]
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5))
    _at_rank(monkeypatch, 0, 1)
    whole = MergedColumnParallelLinear(k, sizes, bias=False, dtype=torch.float32)
    _load(whole, Int4LinearMethod(fmt, 32, 1 if fmt == "gptq" else 0), parts)
    gate, up = whole.quant_method.apply(whole, x).split(sizes, dim=1)
    for rank in range(2):
        _at_rank(monkeypatch, rank, 2)
        layer = MergedColumnParallelLinear(k, sizes, bias=False, dtype=torch.float32)
        _load(layer, Int4LinearMethod(fmt, 32, 1 if fmt == "gptq" else 0), parts)
        got = layer.quant_method.apply(layer, x)
        expected = torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_splits_inside_a_group_or_a_pack_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _at_rank(monkeypatch, 1, 2)
    # 64 inputs in groups of 64: each rank would hold half a group
    layer = RowParallelLinear(64, 32, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="gptq groups of 64.*not a multiple of the checkpoint's 64"):
        Int4LinearMethod("gptq", 64, 1).create_weights(layer, 32, [32], 64, 32, torch.float32)
    # 4 ranks x 12 inputs: GPTQ packs 8 input rows to an int32
    _at_rank(monkeypatch, 1, 4)
    layer = RowParallelLinear(48, 32, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"gptq qweight \(8 input features to an int32\)"):
        Int4LinearMethod("gptq", -1, 1).create_weights(layer, 12, [32], 48, 32, torch.float32)
    # AWQ packs 8 output columns to an int32: 8 columns on two ranks is 4 each
    _at_rank(monkeypatch, 1, 2)
    column = MergedColumnParallelLinear(64, [8, 8], bias=False, dtype=torch.float32)
    method = Int4LinearMethod("awq", 32, 0)
    method.create_weights(column, 64, column.output_partition_sizes, 64, 16, torch.float32)
    tensors = _checkpoint("awq", 8, 64, 32, False, seed=0)
    with pytest.raises(ValueError, match="awq qweight.*not on the checkpoint's packing of 8"):
        column.qweight.weight_loader(column.qweight, tensors["qweight"], 0)


def test_a_quantized_lm_head_is_refused_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocab-parallel head pads the vocabulary to the ranks; its packed columns are not split (GPTQ lm_head)."""
    from pagoda.layers.vocab_parallel_embedding import ParallelLMHead

    _at_rank(monkeypatch, 0, 2)
    head = ParallelLMHead(64, 64, bias=False, dtype=torch.float32)
    method = Int4LinearMethod("gptq", 32, 1)
    method.create_weights(head, 64, head.output_partition_sizes, 64, 64, torch.float32)
    tensors = _checkpoint("gptq", 64, 64, 32, False, seed=0)
    with pytest.raises(ValueError, match="a quantized LM head is not split across tensor-parallel ranks"):
        head.qweight.weight_loader(head.qweight, tensors["qweight"], None)
