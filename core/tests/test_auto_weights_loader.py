"""core's AutoWeightsLoader: packed modules, a module's own checkpoint shards, each parameter's weight_loader,
and every unknown, misfit or missing checkpoint tensor named."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.distributed.parallel_state import GroupCoordinator
from pagoda.layers import LayerNorm, PerHeadLayerNorm, QKVParallelLinear, RowParallelLinear
from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader

F32 = torch.float32
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 4 heads of 2, 2 KV heads, hidden 8
        self.qkv_proj = QKVParallelLinear(8, 2, 4, 2, True, F32)
        self.o_proj = RowParallelLinear(8, 8, False, F32)
        self.q_norm = PerHeadLayerNorm(self.qkv_proj.num_heads, 2, 1e-5, F32, total_num_heads=4,
                                       first_head=parallel_state.get_tensor_model_parallel_rank() * self.qkv_proj.num_heads)
        self.norm = LayerNorm(8, 1e-5, F32)


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"{p}.weight": torch.randn(rows, 8, generator=g) for p, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
    state |= {f"{p}.bias": torch.randn(rows, generator=g) for p, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
    state["o_proj.weight"] = torch.randn(8, 8, generator=g)
    state |= {f"q_norm.norms.{h}.weight": torch.randn(2, generator=g) for h in range(4)}
    state |= {"norm.weight": torch.randn(8, generator=g), "norm.bias": torch.randn(8, generator=g)}
    return state


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(list(range(size)), rank, None))

    return set_rank


def test_one_rank_loads_every_tensor_where_it_belongs() -> None:
    state = _checkpoint()
    block = Block()
    loaded = AutoWeightsLoader(block, packed_modules_mapping=PACKED).load_weights(state.items())
    assert loaded == set(state)
    qkv = torch.cat([state["q_proj.weight"], state["k_proj.weight"], state["v_proj.weight"]])
    assert torch.equal(block.qkv_proj.weight, qkv)
    assert torch.equal(block.q_norm.weight, torch.stack([state[f"q_norm.norms.{h}.weight"] for h in range(4)]))
    assert torch.equal(block.norm.bias, state["norm.bias"])


def test_rank_one_of_two_takes_its_heads(as_rank: Callable[[int, int], None]) -> None:
    as_rank(1, 2)
    state = _checkpoint()
    block = Block()
    AutoWeightsLoader(block, packed_modules_mapping=PACKED).load_weights(state.items())
    # rank 1: query heads 2-3 (rows 4-7), KV head 1 (rows 2-3 of k and v)
    expected = torch.cat([state["q_proj.weight"][4:], state["k_proj.weight"][2:], state["v_proj.weight"][2:]])
    assert torch.equal(block.qkv_proj.weight, expected)
    assert torch.equal(block.o_proj.weight, state["o_proj.weight"][:, 4:])
    assert torch.equal(block.q_norm.weight, torch.stack([state["q_norm.norms.2.weight"], state["q_norm.norms.3.weight"]]))


def test_unknown_misfit_and_missing_tensors_are_named() -> None:
    state = _checkpoint()
    with pytest.raises(ValueError, match="'q_norm.norms.4.weight' matches no parameter"):
        AutoWeightsLoader(Block(), packed_modules_mapping=PACKED).load_weights(
            {**state, "q_norm.norms.4.weight": torch.ones(2)}.items())
    with pytest.raises(ValueError, match=r"'k_proj.weight' has shape \(3, 8\)"):
        AutoWeightsLoader(Block(), packed_modules_mapping=PACKED).load_weights(
            {**state, "k_proj.weight": torch.ones(3, 8)}.items())
    partial = {n: t for n, t in state.items() if n not in ("v_proj.bias", "q_norm.norms.1.weight")}
    with pytest.raises(ValueError, match=r"missing weight\(s\) v_proj.bias, q_norm.norms.1.weight"):
        AutoWeightsLoader(Block(), packed_modules_mapping=PACKED).load_weights(partial.items())


def test_renames_skips_and_a_fused_checkpoint_tensor() -> None:
    state = _checkpoint()
    fused = {n: t for n, t in state.items() if not n.startswith(("q_proj", "k_proj", "v_proj"))}
    fused["qkv_proj.weight"] = torch.cat([state["q_proj.weight"], state["k_proj.weight"], state["v_proj.weight"]])
    fused["qkv_proj.bias"] = torch.cat([state["q_proj.bias"], state["k_proj.bias"], state["v_proj.bias"]])
    renamed = {f"model.{n}": t for n, t in fused.items()} | {"model.rotary_emb.inv_freq": torch.ones(1),
                                                             "model.head.weight": torch.ones(1)}
    block = Block()
    loader = AutoWeightsLoader(block, packed_modules_mapping=PACKED, skip_suffixes=("rotary_emb.inv_freq",),
                               skip_prefixes=("head.",), name_mapper=lambda n: n.removeprefix("model."),
                               inverse_name_mapper=lambda n: f"model.{n}")
    loaded = loader.load_weights(renamed.items())
    assert loaded == {f"model.{n}" for n in fused}
    assert torch.equal(block.qkv_proj.weight, fused["qkv_proj.weight"])
    with pytest.raises(ValueError, match=r"missing weight\(s\) model.norm.bias"):
        AutoWeightsLoader(Block(), packed_modules_mapping=PACKED, name_mapper=lambda n: n.removeprefix("model."),
                          inverse_name_mapper=lambda n: f"model.{n}").load_weights(
            (n, t) for n, t in renamed.items() if n.startswith("model.") and n != "model.norm.bias"
            and "inv_freq" not in n and "head" not in n)


def test_parameters_made_anew_by_to_empty_use_their_layer_loader(as_rank: Callable[[int, int], None]) -> None:
    as_rank(1, 2)
    with torch.device("meta"):
        block = Block()
    block.to_empty(device="cpu")
    assert not hasattr(block.qkv_proj.weight, "weight_loader")
    state = _checkpoint()
    AutoWeightsLoader(block, packed_modules_mapping=PACKED).load_weights(state.items())
    assert torch.equal(block.o_proj.weight, state["o_proj.weight"][:, 4:])
