"""Runs a model family's layers over a real paged KV cache, step by step, without an engine.

``PagedKVHarness`` binds ``DenseTestBackend`` and a paged cache to every
``Attention`` layer of a model and builds each step's ``AttentionMetadata``
from (sequence, new tokens) pairs, so a model family's tests (pagoda's
``models_llama`` and a third party's) can check prefill, chunked prefill and
decode against a dense implementation such as transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata, AttentionSpec
from pagoda.testing.attention.dense import DenseTestBackend


@dataclass
class PagedSequence:
    """One sequence's KV blocks (deliberately not contiguous) and how many tokens are cached."""

    block_ids: list[int]
    num_cached: int = 0


class PagedKVHarness:
    """Binds the dense backend and one paged cache per attention layer, and builds step metadata."""

    def __init__(self, model: nn.Module, num_blocks: int = 64, block_size: int = 4) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        dtype, self.device = param.dtype, param.device
        # Hand out blocks from the top down so block ids and token order disagree.
        self._free = list(range(num_blocks - 1, 0, -1))
        for layer in model.modules():
            if isinstance(layer, Attention):
                spec = AttentionSpec(
                    num_heads=layer.num_heads,
                    num_kv_heads=layer.num_kv_heads,
                    head_dim=layer.head_dim,
                    dtype=dtype,
                    device_type=self.device.type,
                    block_size=block_size,
                    sliding_window=layer.sliding_window,
                    alibi_slopes=layer.alibi_slopes_tuple(),
                )
                shape = DenseTestBackend.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
                layer.bind(DenseTestBackend(spec), torch.zeros(shape, dtype=dtype, device=self.device))

    def new_sequence(self, max_tokens: int) -> PagedSequence:
        needed = (max_tokens + self.block_size - 1) // self.block_size
        if needed > len(self._free):
            raise ValueError(f"harness has {len(self._free)} free blocks, sequence needs {needed}")
        blocks = [self._free.pop() for _ in range(needed)][::-1]
        return PagedSequence(block_ids=blocks)

    def step(self, scheduled: list[tuple[PagedSequence, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Metadata for one step where each (sequence, num_new) appends num_new tokens; returns positions too."""
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        for seq, num_new in scheduled:
            for pos in range(seq.num_cached, seq.num_cached + num_new):
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(query_start[-1] + num_new)
            seq_lens.append(seq.num_cached + num_new)
            seq.num_cached += num_new
        max_blocks = max(len(seq.block_ids) for seq, _ in scheduled)
        tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for i, (seq, _) in enumerate(scheduled):
            tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        query_start_loc = torch.tensor(query_start, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            num_seqs=len(scheduled),
            num_tokens=len(positions),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens_t.to(self.device),
            block_tables=tables.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_t,
            is_all_decode=all(n == 1 for _, n in scheduled),
        )
        return torch.tensor(positions, dtype=torch.int64, device=self.device), metadata
