"""The tensor work of one layer call: KV write, then attention per group of the plan.

Long prefills go through core's ``pagoda.attention.prefill``; the batched groups and the
bidirectional dense runs are torch_paged's own, on core's ``pagoda.attention.sdpa``.
"""

from __future__ import annotations

from functools import partial

import torch

from pagoda.attention.interface import AttentionLayerParams
from pagoda.attention.kv_quant import byte_view, is_fp8, quantize_kv, read_cached
from pagoda.attention.sdpa import alibi_bias, attend
from pagoda_attn_torch.plan import BatchedGroup, DenseRun, StepPlan


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan,
             params: AttentionLayerParams) -> None:
    """Store the new tokens' K/V at their slots (rows with slot -1 are skipped); fp8: scaled, saturated."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if plan.write_rows is None:
        key, value = key[: plan.num_tokens], value[: plan.num_tokens]
    else:
        key, value = key.index_select(0, plan.write_rows), value.index_select(0, plan.write_rows)
    key = quantize_kv(key, kv_cache.dtype, _scale(params.k_scale, kv_cache))
    value = quantize_kv(value, kv_cache.dtype, _scale(params.v_scale, kv_cache))
    byte_view(key_slots).index_copy_(0, plan.write_slots, byte_view(key))
    byte_view(value_slots).index_copy_(0, plan.write_slots, byte_view(value))


def _scale(scale: torch.Tensor | None, kv_cache: torch.Tensor) -> torch.Tensor | float:
    if scale is None and is_fp8(kv_cache.dtype):
        raise ValueError(f"an fp8 KV cache ({kv_cache.dtype}) needs the layer's k_scale and v_scale")
    return 1.0 if scale is None else scale


def attend_batched(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: BatchedGroup,
    group_index: int,
    plan: StepPlan,
    params: AttentionLayerParams,
) -> torch.Tensor:
    """Attention for the batched group -> [num_seqs, max_query_len, num_heads, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    n, max_q, kv_len = group.num_seqs, group.max_query_len, group.padded_kv_len
    gathered_shape = (group.block_ids.numel(), block_size, num_kv_heads, head_dim)
    k_buf = plan.workspace.buffer(f"batched_k{group_index}", gathered_shape, kv_cache.dtype, kv_cache.device)
    v_buf = plan.workspace.buffer(f"batched_v{group_index}", gathered_shape, kv_cache.dtype, kv_cache.device)
    torch.index_select(byte_view(kv_cache[0]), 0, group.block_ids, out=byte_view(k_buf))
    torch.index_select(byte_view(kv_cache[1]), 0, group.block_ids, out=byte_view(v_buf))
    keys = read_cached(k_buf, query.dtype, params.k_scale).view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    values = read_cached(v_buf, query.dtype, params.v_scale).view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)

    rows = query if group.query_rows is None else query.index_select(0, group.query_rows)
    queries = rows.view(n, max_q, -1, head_dim).transpose(1, 2)  # [n, heads, max_q, head_dim]
    slopes = params.alibi_slopes
    bias = None if slopes is None else alibi_bias(slopes, group.relative_positions())
    out = attend(queries, keys, values, partial(group.mask, params.sliding_window), params.scale,
                 params.logits_soft_cap, causal=False, bias=bias)
    return out.transpose(1, 2)


def attend_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    run: DenseRun,
    params: AttentionLayerParams,
) -> torch.Tensor:
    """Bidirectional attention over whole sequences of one length -> [num_seqs * seq_len, heads, head_dim]."""
    n, length = run.num_seqs, run.seq_len
    rows = slice(run.row_start, run.row_start + n * length)
    k_scale, v_scale = params.k_scale, params.v_scale
    # through the cache dtype, as if read back from the cache (a no-op when the dtypes agree)
    keys, values = key[rows], value[rows]
    if is_fp8(kv_cache.dtype):
        keys = read_cached(quantize_kv(keys, kv_cache.dtype, _scale(k_scale, kv_cache)), query.dtype, k_scale)
        values = read_cached(quantize_kv(values, kv_cache.dtype, _scale(v_scale, kv_cache)), query.dtype, v_scale)
    else:
        keys, values = keys.to(kv_cache.dtype), values.to(kv_cache.dtype)
    keys = keys.view(n, length, key.shape[1], key.shape[2]).transpose(1, 2)
    values = values.view(n, length, value.shape[1], value.shape[2]).transpose(1, 2)
    queries = query[rows].view(n, length, query.shape[1], query.shape[2]).transpose(1, 2)
    bias = None
    if params.alibi_slopes is not None:
        positions = torch.arange(length, device=query.device)
        bias = alibi_bias(params.alibi_slopes, (positions - positions.unsqueeze(-1)).float()[None, None])
    out = attend(queries, keys, values, None, params.scale, params.logits_soft_cap, causal=False, bias=bias)
    return out.transpose(1, 2).reshape(n * length, query.shape[1], query.shape[2])
