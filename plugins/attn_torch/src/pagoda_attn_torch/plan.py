"""Per-step planning: everything about the batch layout that every layer shares.

Built once per step by ``TorchPagedAttentionBackend.prepare`` from host copies of
the metadata, so the per-layer ``forward`` does no index math and no host syncs.

Sequences split into two groups:
- *batched*: every sequence with few new tokens (all decodes, short chunks).
  Their queries are padded to the group's longest query, their cached K/V
  gathered block-wise into one rectangle, and attention runs as one batched
  matmul/softmax under a mask. Decodes and short chunks form separate groups,
  and when lengths differ a lot a group is split into a few length buckets, so
  short sequences are not padded to the longest.
- *looped*: long prefills (or chunks of them), attended one sequence at a time,
  where padding them into the rectangle would waste more than the loop costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.attention.interface import AttentionMetadata
from pagoda.attention.prefill import PrefillSequence
from pagoda.attention.sdpa import additive_mask
from pagoda.attention.workspace import Workspace

# Sequences with at most this many new tokens go into the batched group; longer
# ones are attended one by one (their own matmuls are big enough to be efficient).
BATCHED_QUERY_LIMIT = 16
# A sequence needing at most this fraction of a bucket's longest length starts a new bucket...
BUCKET_SPLIT_RATIO = 0.5
# ...up to this many buckets (each costs a fixed few ops per layer).
MAX_BUCKETS = 4


@dataclass
class BatchedGroup:
    """Sequences attended together as one padded rectangle."""

    num_seqs: int
    max_query_len: int
    # Key positions covered by the gathered blocks (a multiple of block_size).
    padded_kv_len: int
    # [num_seqs * blocks_per_seq] int64: cache blocks to gather, sequence-major.
    block_ids: torch.Tensor
    # [num_seqs, max_query_len] int64: absolute position of each query row;
    # padding rows get position 0 so their softmax stays finite.
    positions: torch.Tensor
    # [num_seqs * max_query_len] int64: flat-batch row of each padded query row
    # (padding rows repeat a real row); None when the rows are 0..num_tokens-1 in order.
    query_rows: torch.Tensor | None
    # Where the real rows of the padded result land in the output:
    # result_index selects them from the padded result, output_rows names their rows.
    # Both None when the padded result is the output as is.
    result_index: torch.Tensor | None
    output_rows: torch.Tensor | None
    # Additive masks [num_seqs, 1, max_query_len, padded_kv_len] per (window, dtype), built lazily.
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _relative: torch.Tensor | None = field(default=None, init=False, repr=False)

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        key = (sliding_window, dtype)
        cached = self.masks.get(key)
        if cached is None:
            built = additive_mask(self.positions, self.padded_kv_len, sliding_window)
            cached = built.unsqueeze(1).to(dtype)
            self.masks[key] = cached
        return cached

    def relative_positions(self) -> torch.Tensor:
        """[num_seqs, 1, max_query_len, padded_kv_len] float32 key_pos - query_pos (ALiBi), built once per step."""
        if self._relative is None:
            keys = torch.arange(self.padded_kv_len, device=self.positions.device)
            self._relative = (keys - self.positions.unsqueeze(-1)).unsqueeze(1).float()
        return self._relative


@dataclass
class DenseRun:
    """Bidirectional attention: consecutive whole sequences (nothing cached before) of one length.

    Their rows are contiguous in the flat batch, so q/k/v are viewed as
    [num_seqs, seq_len, heads, head_dim] without a gather, and attention
    needs no mask: every token sees every token of its own sequence.
    """

    row_start: int
    num_seqs: int
    seq_len: int


@dataclass
class StepPlan:
    num_tokens: int
    # Rows that belong to some sequence (rows past it are batch padding: output 0).
    num_real_tokens: int
    # Rows whose K/V are written and the slots they go to; write_rows is None when all rows are written.
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    batched: list[BatchedGroup]
    looped: list[PrefillSequence]
    # bidirectional steps only: whole sequences attended without reading the cache
    dense: list[DenseRun] = field(default_factory=list)
    # bidirectional: a key is visible to every query of its sequence (masks built from seq_len)
    causal: bool = True
    # Per-step scratch reused by every layer (fresh large buffers cost page faults on CPU).
    workspace: Workspace = field(default_factory=Workspace)


def _host(tensor: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return tensor if tensor is not None else fallback.cpu()


def build_plan(metadata: AttentionMetadata, block_size: int, causal: bool = True) -> StepPlan:
    device = metadata.block_tables.device
    query_start = _host(metadata.query_start_loc_cpu, metadata.query_start_loc).to(torch.int64)
    seq_lens = _host(metadata.seq_lens_cpu, metadata.seq_lens).to(torch.int64)
    num_seqs = metadata.num_seqs
    if query_start.numel() != num_seqs + 1 or seq_lens.numel() != num_seqs:
        raise ValueError(
            f"attention metadata: query_start_loc has {query_start.numel()} entries and seq_lens "
            f"{seq_lens.numel()}, expected {num_seqs + 1} and {num_seqs} for num_seqs={num_seqs}"
        )
    query_lens = query_start[1:] - query_start[:-1]
    context_lens = seq_lens - query_lens
    if num_seqs and (int(query_lens.min()) < 0 or int(context_lens.min()) < 0):
        raise ValueError("attention metadata: seq_lens must be >= query lengths and query_start_loc non-decreasing")
    num_real_tokens = int(query_start[-1]) if num_seqs else 0
    if num_real_tokens > metadata.num_tokens:
        raise ValueError(
            f"attention metadata: sequences cover {num_real_tokens} rows but num_tokens={metadata.num_tokens}"
        )

    write_rows, write_slots = _plan_writes(metadata.slot_mapping[: metadata.num_tokens])
    if not causal:
        return _plan_bidirectional(metadata, block_size, query_start, query_lens, context_lens, seq_lens,
                                   num_real_tokens, write_rows, write_slots)

    short = (query_lens <= BATCHED_QUERY_LIMIT) & (query_lens > 0)
    batched_ids = torch.nonzero(short).flatten()
    looped_ids = torch.nonzero(~short & (query_lens > 0)).flatten()
    # Decodes apart from short chunks: one 8-token chunk must not pad every decode to 8 queries.
    decode_ids = batched_ids[query_lens[batched_ids] == 1]
    chunk_ids = batched_ids[query_lens[batched_ids] > 1]
    buckets = _length_buckets(decode_ids, seq_lens, block_size) + _length_buckets(chunk_ids, seq_lens, block_size)
    covers_all = looped_ids.numel() == 0 and num_real_tokens == metadata.num_tokens and len(buckets) == 1
    batched = [
        _plan_batched(
            bucket,
            query_start,
            query_lens,
            context_lens,
            seq_lens,
            metadata.block_tables,
            block_size,
            device,
            covers_all,
        )
        for bucket in buckets
    ]
    looped = [
        PrefillSequence(
            row_start=int(query_start[i]),
            row_end=int(query_start[i + 1]),
            context_len=int(context_lens[i]),
            seq_len=int(seq_lens[i]),
            block_ids=metadata.block_tables[int(i), : _cdiv(int(seq_lens[i]), block_size)].to(torch.int64),
        )
        for i in looped_ids.tolist()
    ]
    return StepPlan(
        num_tokens=metadata.num_tokens,
        num_real_tokens=num_real_tokens,
        write_rows=write_rows,
        write_slots=write_slots,
        batched=batched,
        looped=looped,
    )


def _plan_bidirectional(
    metadata: AttentionMetadata,
    block_size: int,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_tokens: int,
    write_rows: torch.Tensor | None,
    write_slots: torch.Tensor,
) -> StepPlan:
    """Whole sequences go into dense runs; a sequence on top of cached tokens is looped under a full mask."""
    dense: list[DenseRun] = []
    looped: list[PrefillSequence] = []
    for i, (q_len, ctx) in enumerate(zip(query_lens.tolist(), context_lens.tolist())):
        if q_len == 0:
            continue
        if ctx == 0:
            last = dense[-1] if dense else None
            if last is not None and last.seq_len == q_len and last.row_start + last.num_seqs * q_len == int(query_start[i]):
                last.num_seqs += 1
            else:
                dense.append(DenseRun(int(query_start[i]), 1, q_len))
            continue
        looped.append(PrefillSequence(
            row_start=int(query_start[i]),
            row_end=int(query_start[i + 1]),
            context_len=ctx,
            seq_len=int(seq_lens[i]),
            block_ids=metadata.block_tables[i, : _cdiv(int(seq_lens[i]), block_size)].to(torch.int64),
            causal=False,
        ))
    return StepPlan(
        num_tokens=metadata.num_tokens,
        num_real_tokens=num_real_tokens,
        write_rows=write_rows,
        write_slots=write_slots,
        batched=[],
        looped=looped,
        dense=dense,
        causal=False,
    )


def _plan_writes(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if bool(valid.all()):
        return None, slots
    rows = torch.nonzero(valid).flatten()
    return rows, slots.index_select(0, rows)


def _length_buckets(seq_ids: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """Split sequences into buckets of similar length (each bucket is padded to its longest)."""
    if seq_ids.numel() == 0:
        return []
    blocks = (seq_lens[seq_ids] + block_size - 1) // block_size
    if int(blocks.min()) > BUCKET_SPLIT_RATIO * int(blocks.max()):
        return [seq_ids]  # the common case: keep batch order, so all-decode output needs no scatter
    order = torch.argsort(blocks, descending=True, stable=True)
    sorted_blocks = blocks[order].tolist()
    starts = [0]
    for i, b in enumerate(sorted_blocks):
        if len(starts) < MAX_BUCKETS and b <= BUCKET_SPLIT_RATIO * sorted_blocks[starts[-1]]:
            starts.append(i)
    ends = starts[1:] + [len(sorted_blocks)]
    return [torch.sort(seq_ids[order[a:b]]).values for a, b in zip(starts, ends, strict=True)]


def _plan_batched(
    seq_ids: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
    covers_all: bool,
) -> BatchedGroup:
    n = seq_ids.numel()
    q_lens = query_lens[seq_ids]
    max_q = int(q_lens.max())
    blocks_per_seq = _cdiv(int(seq_lens[seq_ids].max()), block_size)
    if blocks_per_seq > block_tables.shape[1]:
        raise ValueError(
            f"attention metadata: a sequence needs {blocks_per_seq} blocks but block_tables has {block_tables.shape[1]} columns"
        )
    block_ids = block_tables.index_select(0, seq_ids.to(device))[:, :blocks_per_seq].reshape(-1).to(torch.int64)

    offsets = torch.arange(max_q)
    real = offsets.unsqueeze(0) < q_lens.unsqueeze(1)  # [n, max_q]
    positions = torch.where(real, context_lens[seq_ids].unsqueeze(1) + offsets, 0)
    rows = query_start[seq_ids].unsqueeze(1) + torch.where(real, offsets, 0)

    in_order = covers_all and max_q == 1
    query_rows = None if in_order else rows.reshape(-1)
    result_index = output_rows = None
    if not in_order:
        flat_real = real.reshape(-1)
        result_index = torch.nonzero(flat_real).flatten()
        output_rows = rows.reshape(-1).index_select(0, result_index)
    return BatchedGroup(
        num_seqs=n,
        max_query_len=max_q,
        padded_kv_len=blocks_per_seq * block_size,
        block_ids=block_ids,
        positions=positions.to(device),
        query_rows=None if query_rows is None else query_rows.to(device),
        result_index=None if result_index is None else result_index.to(device),
        output_rows=None if output_rows is None else output_rows.to(device),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
