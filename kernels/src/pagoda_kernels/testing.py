"""Random paged batches for kernel tests and benchmarks (no test framework needed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A flat batch over a paged KV cache whose blocks are scattered at random."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: slots of each sequence's last query_lens tokens
    max_seq_len: int
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """Sequences of ``seq_lens`` tokens whose last ``query_lens`` are this step's new ones.

    The cache is filled with random values everywhere (stale data in unused
    slots must never leak into results); block ids are a random permutation.
    """
    if len(seq_lens) != len(query_lens) or any(q > s or q < 0 for s, q in zip(seq_lens, query_lens, strict=True)):
        raise ValueError(f"need 0 <= query_len <= seq_len per sequence, got {seq_lens} and {query_lens}")
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(blocks_per_seq, default=1) or 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[torch.Tensor] = []
    used = 0
    for i, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[i, :n_blocks] = order[used : used + n_blocks].to(torch.int32)
        used += n_blocks
        positions = torch.arange(seq_len - query_lens[i], seq_len)
        slots.append(block_tables[i, positions // block_size].long() * block_size + positions % block_size)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    return PagedBatch(
        kv_cache=kv_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        slot_mapping=(torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)).to(device),
        max_seq_len=max(seq_lens, default=0),
        max_query_len=max(query_lens, default=0),
    )
