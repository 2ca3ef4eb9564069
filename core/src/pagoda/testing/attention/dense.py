"""Test-only attention: writes K/V into the paged cache by slot, then attends densely per sequence.

Deliberately simple (a Python loop over sequences, the whole history gathered
from the cache through the block table) so it is easy to trust as a reference
for model-family tests; it passes the same conformance cases as the real
backends (core/tests/test_attention_conformance.py).
"""

from __future__ import annotations

import torch

from pagoda.attention import AttentionBackend, AttentionLayerParams, AttentionMetadata


class DenseTestBackend(AttentionBackend[AttentionMetadata]):
    name = "dense-test"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionLayerParams,
    ) -> torch.Tensor:
        scale, sliding_window, logits_soft_cap = params.scale, params.sliding_window, params.logits_soft_cap
        alibi_slopes = params.alibi_slopes
        if params.k_scale is not None:
            raise ValueError("the dense test backend has no fp8 KV cache (supports_fp8_kv_cache is False)")
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        block_size = kv_cache.shape[2]
        keep = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[keep]
        kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep]
        kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep]

        out = torch.zeros_like(query)  # rows past the sequences are batch padding
        group = query.shape[1] // num_kv_heads
        starts = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens.tolist()):
            rows = slice(starts[i], starts[i + 1])
            num_new = starts[i + 1] - starts[i]
            blocks = metadata.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
            keys = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            keys = keys.repeat_interleave(group, dim=1).float()
            values = values.repeat_interleave(group, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", query[rows].float(), keys) * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            if alibi_slopes is not None:
                scores = scores + alibi_slopes.float().view(-1, 1, 1) * (k_pos - q_pos).float()
            # bidirectional (spec.causal False): every new token sees the whole sequence
            allowed = k_pos <= q_pos if self.spec.causal else torch.ones_like(k_pos <= q_pos)
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
        return out
