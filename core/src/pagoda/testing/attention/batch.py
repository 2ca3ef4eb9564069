"""Paged attention batches built from explicit per-sequence K/V.

Every sequence's whole K/V and new queries are kept beside the batch, so the
expected output comes from them (``reference.reference_attention``), never from
the cache the backend under test writes into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagoda.attention.interface import AttentionLayerParams, AttentionMetadata, AttentionSpec

# (cached tokens, new tokens) per sequence
PREFILL = [(0, n) for n in (1, 5, 16, 17, 33, 70)]
CHUNKED = [(20, 30), (37, 50), (16, 16), (5, 3), (64, 17)]
DECODE = [(c, 1) for c in (0, 1, 15, 16, 31, 64, 100)]
MIXED = [(40, 1), (0, 25), (7, 1), (33, 12), (0, 3), (100, 1), (17, 40), (0, 1)]


@dataclass(frozen=True)
class Shape:
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16


@dataclass
class Sequence:
    context_len: int  # tokens already in the cache
    query_len: int  # new tokens this step
    query: torch.Tensor  # [query_len, heads, dim]
    keys: torch.Tensor  # [context_len + query_len, kv_heads, dim], the whole sequence
    values: torch.Tensor
    blocks: list[int]

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class Batch:
    sequences: list[Sequence]
    kv_cache: torch.Tensor
    initial_cache: torch.Tensor
    metadata: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    # Rows past the sequences (batch padding) with slot -1.
    padding_rows: int

    def scale_queries(self, factor: float) -> None:
        """Multiply every query (the batch's and each sequence's copy) by ``factor``, e.g. so a
        logits soft cap actually bends the scores."""
        self.query.mul_(factor)
        for seq in self.sequences:
            seq.query.mul_(factor)


def make_batch(
    lens: list[tuple[int, int]],
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    padding_rows: int = 0,
    spare_blocks: int = 5,
    layout_seed: int | None = None,
) -> Batch:
    """``lens``: (context_len, query_len) per sequence. Blocks are handed out in random order
    (drawn from ``layout_seed``, so layers of one step can share the layout but not the data)."""
    gen = torch.Generator().manual_seed(seed)
    layout_gen = torch.Generator().manual_seed(seed if layout_seed is None else layout_seed)
    h, kvh, d, bs = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    blocks_needed = [-(-(c + q) // bs) for c, q in lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=layout_gen).tolist()
    kv_cache = torch.randn(2, num_blocks, bs, kvh, d, generator=gen).to(dtype)

    sequences = []
    for (context_len, query_len), n_blocks in zip(lens, blocks_needed, strict=True):
        blocks, order = order[:n_blocks], order[n_blocks:]
        total = context_len + query_len
        seq = Sequence(
            context_len=context_len,
            query_len=query_len,
            query=torch.randn(query_len, h, d, generator=gen).to(dtype),
            keys=torch.randn(total, kvh, d, generator=gen).to(dtype),
            values=torch.randn(total, kvh, d, generator=gen).to(dtype),
            blocks=blocks,
        )
        for t in range(context_len):  # the cached prefix, put where the block table says
            kv_cache[0, blocks[t // bs], t % bs] = seq.keys[t]
            kv_cache[1, blocks[t // bs], t % bs] = seq.values[t]
        sequences.append(seq)

    max_blocks = max(blocks_needed) + 1
    block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, seq in enumerate(sequences):
        block_tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        slots += [seq.blocks[t // bs] * bs + t % bs for t in range(seq.context_len, seq.seq_len)]
    slots += [-1] * padding_rows

    query = torch.cat([s.query for s in sequences] + [torch.randn(padding_rows, h, d, generator=gen).to(dtype)])
    key = torch.cat(
        [s.keys[s.context_len :] for s in sequences] + [torch.randn(padding_rows, kvh, d, generator=gen).to(dtype)]
    )
    value = torch.cat(
        [s.values[s.context_len :] for s in sequences] + [torch.randn(padding_rows, kvh, d, generator=gen).to(dtype)]
    )

    query_lens = torch.tensor([q for _, q in lens], dtype=torch.int32)
    query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor([c + q for c, q in lens], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_seqs=len(lens),
        num_tokens=query.shape[0],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens.clone(),
        is_all_decode=bool((query_lens == 1).all()),
    )
    return Batch(sequences, kv_cache, kv_cache.clone(), metadata, query, key, value, padding_rows)


def spec_for(
    shape: Shape, dtype: torch.dtype = torch.float32, device_type: str = "cpu", **spec_fields: Any
) -> AttentionSpec:
    """The ``AttentionSpec`` a model with ``shape`` would ask a backend for."""
    return AttentionSpec(
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        device_type=device_type,
        block_size=shape.block_size,
        **spec_fields,
    )


def params_for(
    shape: Shape,
    scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    **param_fields: Any,
) -> AttentionLayerParams:
    """The ``AttentionLayerParams`` a layer of ``shape`` passes to ``forward`` (``scale``: head_dim**-0.5
    unless given; ``param_fields``: alibi_slopes, k_scale, v_scale)."""
    return AttentionLayerParams(
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        scale=shape.head_dim**-0.5 if scale is None else scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        **param_fields,
    )
