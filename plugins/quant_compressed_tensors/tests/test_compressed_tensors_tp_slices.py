"""The compressed-tensors method's tensor-parallel slicing in one process: each of two ranks (patched in
``pagoda.layers.parallel_linear``) builds a parallel layer, loads the whole checkpoint tensors through the
parameters' ``weight_loader`` and computes its part; the parts must give the one-rank layer's output.
A split inside a group of scales, or inside an int32 of packed int8 values, is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pagoda.layers.parallel_linear as parallel_linear
from pagoda.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from pagoda_quant_compressed_tensors.config import CompressedTensorsLinearMethod, Scheme


def _at_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setattr(parallel_linear, "get_tensor_model_parallel_world_size", lambda: world)
    monkeypatch.setattr(parallel_linear, "get_tensor_model_parallel_rank", lambda: rank)


def _scheme(strategy: str, group_size: int | None, w8a8: bool) -> Scheme:
    return Scheme(("Linear",), strategy, group_size, w8a8, "int-quantized")


def _tensors(n: int, k: int, groups: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"weight": torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
            "weight_scale": torch.rand(n, groups, generator=gen) * 0.01 + 1e-3}


def _load(layer: Any, scheme: Scheme, parts: list[dict[str, torch.Tensor]]) -> CompressedTensorsLinearMethod:
    method = CompressedTensorsLinearMethod(scheme)
    method.create_weights(layer, layer.in_features, list(getattr(layer, "output_partition_sizes", [layer.out_features])),
                          getattr(layer, "input_size", layer.in_features), layer.out_features, torch.float32)
    layer.quant_method = method
    for shard_id, tensors in enumerate(parts):
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard_id if len(parts) > 1 else None)
    method.process_weights_after_loading(layer)
    return method


@pytest.mark.parametrize("strategy,group_size", [("channel", None), ("group", 32)], ids=["channel", "group32"])
def test_w8a16_row_parallel_ranks_sum_to_the_whole_layer(monkeypatch: pytest.MonkeyPatch, strategy: str,
                                                         group_size: int | None) -> None:
    n, k = 48, 128
    scheme = _scheme(strategy, group_size, w8a8=False)
    tensors = _tensors(n, k, k // group_size if group_size else 1, seed=1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    _at_rank(monkeypatch, 0, 1)
    whole = RowParallelLinear(k, n, bias=False, dtype=torch.float32)
    expected = _load(whole, scheme, [tensors]).apply(whole, x)
    total = torch.zeros_like(expected)
    for rank in range(2):
        _at_rank(monkeypatch, rank, 2)
        layer = RowParallelLinear(k, n, bias=False, dtype=torch.float32)
        method = _load(layer, scheme, [tensors])
        assert (method.in_features, method.out_features) == (k // 2, n)
        total += method.apply(layer, x[:, rank * (k // 2):(rank + 1) * (k // 2)])
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)


def test_w8a8_merged_column_parallel_ranks_hold_their_rows_of_each_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    k, sizes = 64, [32, 48]
    scheme = _scheme("channel", None, w8a8=True)
    parts = [_tensors(n, k, 1, seed=3 + i) for i, n in enumerate(sizes)]
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5))
    _at_rank(monkeypatch, 0, 1)
    whole = MergedColumnParallelLinear(k, sizes, bias=False, dtype=torch.float32)
    gate, up = _load(whole, scheme, parts).apply(whole, x).split(sizes, dim=1)
    for rank in range(2):
        _at_rank(monkeypatch, rank, 2)
        layer = MergedColumnParallelLinear(k, sizes, bias=False, dtype=torch.float32)
        got = _load(layer, scheme, parts).apply(layer, x)
        # the same input, whole on every rank: the same per-token int8 rounding, so the same rows
        torch.testing.assert_close(got, torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1))


def test_splits_inside_a_group_or_a_pack_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _at_rank(monkeypatch, 1, 2)
    layer = RowParallelLinear(64, 32, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="compressed-tensors groups of 64.*not a multiple of the checkpoint's 64"):
        CompressedTensorsLinearMethod(_scheme("group", 64, w8a8=False)).create_weights(
            layer, 32, [32], 64, 32, torch.float32)
    _at_rank(monkeypatch, 1, 4)
    layer = RowParallelLinear(24, 32, bias=False, dtype=torch.float32)  # 6 inputs a rank: not whole int32s
    packed = Scheme(("Linear",), "channel", None, True, "pack-quantized")
    with pytest.raises(ValueError, match=r"compressed-tensors weight_packed \(four int8 values to an int32\)"):
        CompressedTensorsLinearMethod(packed).create_weights(layer, 6, [32], 24, 32, torch.float32)
