"""Tensor-parallel layers on a faked rank (no process group): each rank's slice, and the slices put back together."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pagoda.distributed import parallel_state
from pagoda.distributed.parallel_state import GroupCoordinator
from pagoda.layers import (
    Linear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tensor_parallel_support,
)

F32 = torch.float32


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """Make the layers built next believe they are ``rank`` of ``size`` (collectives are the identity)."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator(list(range(size)), rank, None))

    return set_rank


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard)


def test_merged_column_slices_each_projection(as_rank: Callable[[int, int], None]) -> None:
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    slices = []
    for rank in range(2):
        as_rank(rank, 2)
        layer = MergedColumnParallelLinear(4, [8, 8], False, F32)
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        assert layer.weight.shape == (8, 4)
        slices.append(layer.weight.data)
    # rank r holds [gate_r; up_r] so the gated activation finds both halves side by side
    assert torch.equal(slices[1], torch.cat([gate[4:], up[4:]]))
    # a checkpoint that stores them stacked (Phi-3) loads the same
    as_rank(1, 2)
    stacked = MergedColumnParallelLinear(4, [8, 8], False, F32)
    _load(stacked, "weight", torch.cat([gate, up]))
    assert torch.equal(stacked.weight.data, slices[1])


def test_qkv_replicates_a_kv_head_shared_by_ranks(as_rank: Callable[[int, int], None]) -> None:
    head, hidden = 2, 4
    q, k, v = torch.randn(4 * head, hidden), torch.randn(head, hidden), torch.randn(head, hidden)
    for rank in range(2):
        as_rank(rank, 2)
        layer = QKVParallelLinear(hidden, head, 4, 1, False, F32)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 2)
        for i, part in enumerate((q, k, v)):
            _load(layer, "weight", part, i)
        expected = torch.cat([q[rank * 2 * head:(rank + 1) * 2 * head], k, v])
        assert torch.equal(layer.weight.data, expected)
    as_rank(0, 4)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        QKVParallelLinear(hidden, head, 6, 2, False, F32)
    with pytest.raises(ValueError, match="shape"):
        _load(QKVParallelLinear(hidden, head, 4, 2, False, F32), "weight", torch.randn(3, hidden), 1)


def test_row_parallel_partial_sums_add_up(as_rank: Callable[[int, int], None]) -> None:
    weight, bias, x = torch.randn(3, 8), torch.randn(3), torch.randn(5, 8)
    total = torch.zeros(5, 3)
    for rank in range(2):
        as_rank(rank, 2)
        layer = RowParallelLinear(8, 3, True, F32)
        _load(layer, "weight", weight)
        _load(layer, "bias", bias)
        # with the collective the identity, each rank's forward is its partial product plus the bias once
        total += layer(x[:, rank * 4:(rank + 1) * 4]) - bias
    torch.testing.assert_close(total + bias, F.linear(x, weight, bias))


def test_vocab_parallel_embedding_and_lm_head_pad_an_odd_vocabulary(as_rank: Callable[[int, int], None]) -> None:
    table, ids = torch.randn(7, 3), torch.tensor([0, 3, 4, 6])
    looked_up = torch.zeros(4, 3)
    heads = []
    for rank in range(2):
        as_rank(rank, 2)
        embedding = VocabParallelEmbedding(7, 3, F32)
        _load(embedding, "weight", table)
        assert embedding.weight.shape == (4, 3)  # 7 rows padded to 8, four a rank
        looked_up += embedding(ids)  # ids of the other rank give zeros
        head = ParallelLMHead(7, 3, False, F32)
        _load(head, "weight", table)
        heads.append(head.weight.data)
    torch.testing.assert_close(looked_up, table[ids])
    assert torch.equal(torch.cat(heads)[:7], table) and not torch.cat(heads)[7:].any()


def test_plain_layers_are_refused_above_one_rank(as_rank: Callable[[int, int], None]) -> None:
    as_rank(0, 1)
    model = torch.nn.Sequential(Linear(4, 4, False, F32))
    check_tensor_parallel_support(model, "PlainForCausalLM")  # one rank: anything goes
    as_rank(0, 2)
    with pytest.raises(ValueError, match="PlainForCausalLM does not support tensor parallelism: its layers 0"):
        check_tensor_parallel_support(model, "PlainForCausalLM")
    check_tensor_parallel_support(torch.nn.Sequential(RowParallelLinear(4, 4, False, F32)), "SplitForCausalLM")
