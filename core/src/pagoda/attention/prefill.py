"""Attention of one prefill (or prefill chunk) over the paged cache, in torch, one sequence at a time.

For the backends that plan a step's long prefills apart from its decodes: ``torch_paged``
loops over them, ``cpu_paged`` hands its long fresh ones here (torch's causal SDPA beats
its kernel from ~1,500 tokens on). A ``PrefillSequence`` is planned once per step and
shared by every layer; ``prefill_attention`` is one layer's work on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from pagoda.attention.interface import AttentionLayerParams
from pagoda.attention.kv_quant import byte_view, read_cached
from pagoda.attention.sdpa import additive_mask, alibi_bias, attend
from pagoda.attention.workspace import Workspace


@dataclass
class PrefillSequence:
    """One sequence's new tokens (rows ``row_start:row_end`` of the flat batch) over its whole history."""

    row_start: int
    row_end: int
    context_len: int
    seq_len: int
    # [ceil(seq_len / block_size)] int64 cache blocks holding the sequence.
    block_ids: torch.Tensor
    # Additive [new tokens, seq_len] masks per (window, dtype), built lazily, shared by the step's layers.
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)
    # False: every new token sees all seq_len tokens (bidirectional attention)
    causal: bool = True
    _relative: torch.Tensor | None = field(default=None, init=False, repr=False)

    def relative_positions(self) -> torch.Tensor:
        """[1, 1, new tokens, seq_len] float32 key_pos - query_pos (ALiBi), built once per step."""
        if self._relative is None:
            device = self.block_ids.device
            queries = torch.arange(self.context_len, self.seq_len, device=device)
            keys = torch.arange(self.seq_len, device=device)
            self._relative = (keys - queries.unsqueeze(-1)).float()[None, None]
        return self._relative

    def is_plain_causal(self, sliding_window: int | None) -> bool:
        """True when the new tokens attend only to each other, causally, with no window."""
        return self.causal and self.context_len == 0 and sliding_window is None

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive [new tokens, seq_len] mask."""
        key = (sliding_window, dtype)
        cached = self.masks.get(key)
        if cached is None:
            positions = torch.arange(self.context_len, self.seq_len, device=self.block_ids.device)
            if not self.causal:
                # every query "stands at" the last position: all keys of the sequence are visible
                positions = torch.full_like(positions, self.seq_len - 1)
            cached = additive_mask(positions, self.seq_len, sliding_window).to(dtype)
            self.masks[key] = cached
        return cached


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSequence,
    index: int,
    params: AttentionLayerParams,
    workspace: Workspace,
) -> torch.Tensor:
    """``seq``'s attention -> [new tokens, num_heads, head_dim] (the K/V already written to ``kv_cache``).

    ``index``: the sequence's place among the step's prefills (its gather buffers in ``workspace``).
    A fresh causal sequence without a window, whose cache holds ``key``'s dtype, reads its K/V from
    ``key`` / ``value`` (nothing before it to read back); any other gathers its blocks from the cache.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    sliding_window = params.sliding_window
    rows = slice(seq.row_start, seq.row_end)
    causal = seq.is_plain_causal(sliding_window) and key.dtype == kv_cache.dtype
    if causal:
        keys, values = key[rows], value[rows]
    else:
        gathered_shape = (seq.block_ids.numel(), block_size, num_kv_heads, head_dim)
        k_buf = workspace.buffer(f"looped_k{index}", gathered_shape, kv_cache.dtype, kv_cache.device)
        v_buf = workspace.buffer(f"looped_v{index}", gathered_shape, kv_cache.dtype, kv_cache.device)
        torch.index_select(byte_view(kv_cache[0]), 0, seq.block_ids, out=byte_view(k_buf))
        torch.index_select(byte_view(kv_cache[1]), 0, seq.block_ids, out=byte_view(v_buf))
        keys = read_cached(k_buf.view(-1, num_kv_heads, head_dim)[: seq.seq_len], query.dtype, params.k_scale)
        values = read_cached(v_buf.view(-1, num_kv_heads, head_dim)[: seq.seq_len], query.dtype, params.v_scale)
    queries = query[rows].transpose(0, 1).unsqueeze(0)
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)

    slopes = params.alibi_slopes
    bias = None if slopes is None else alibi_bias(slopes, seq.relative_positions())
    out = attend(queries, keys, values, partial(seq.mask, sliding_window), params.scale, params.logits_soft_cap,
                 causal=causal, bias=bias)
    return out[0].transpose(0, 1)
