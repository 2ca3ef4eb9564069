"""The vocabulary split across tensor-parallel ranks (vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``).

The vocabulary is padded to a multiple of the rank count; rank r holds rows
``[r * per_rank, (r + 1) * per_rank)`` of the table (padding rows are zero).
A lookup embeds the ids this rank holds, zeros the others and all-reduces; the
LM head computes this rank's logit columns and all-gathers them, dropping the
padding. Both keep one layout, so a tied LM head shares the embedding's tensor
on every rank. With one rank both are exactly ``Embedding`` / ``Linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagoda.layers.embedding import Embedding
from pagoda.layers.parallel_linear import ColumnParallelLinear


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def _load_vocab_rows(param: nn.Parameter, loaded_weight: torch.Tensor, vocab_size: int, start: int) -> None:
    """This rank's rows of a [vocab, ...] tensor into ``param``; rows past the vocabulary are zero."""
    if loaded_weight.shape[0] != vocab_size or tuple(loaded_weight.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, the vocabulary layer expects "
                         f"({vocab_size}, {', '.join(str(d) for d in param.shape[1:])})")
    rows = max(0, min(param.shape[0], vocab_size - start))
    param.data[:rows].copy_(loaded_weight[start:start + rows])
    param.data[rows:].zero_()


class VocabParallelEmbedding(Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        super().__init__(self.num_embeddings_per_partition, embedding_dim, dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        _load_vocab_rows(param, loaded_weight, self.org_vocab_size, self.vocab_start_index)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """Hidden states -> logits over the whole vocabulary, each rank computing its slice of it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool, dtype: torch.dtype) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, tp)
        super().__init__(embedding_dim, self.num_embeddings_padded, bias, dtype, gather_output=True)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        per_rank = self.output_partition_sizes[0]
        _load_vocab_rows(param, loaded_weight, self.org_vocab_size, self.tp_rank * per_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.num_embeddings_padded != self.org_vocab_size:
            logits = logits[..., : self.org_vocab_size]
        return logits
