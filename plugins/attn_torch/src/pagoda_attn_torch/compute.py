"""The tensor work of one layer call: KV write, then attention per group of the plan."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagoda.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from pagoda_attn_torch.plan import BatchedGroup, DenseRun, LoopedSequence, StepPlan

# dtype -> additive mask broadcastable to [batch, heads, queries, keys]; built lazily, cached per step.
MaskFor = Callable[[torch.dtype], torch.Tensor]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Store the new tokens' K/V at their slots (rows with slot -1 are skipped); fp8: scaled, saturated."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if plan.write_rows is None:
        key, value = key[: plan.num_tokens], value[: plan.num_tokens]
    else:
        key, value = key.index_select(0, plan.write_rows), value.index_select(0, plan.write_rows)
    key = quantize_kv(key, kv_cache.dtype, _scale(k_scale, kv_cache))
    value = quantize_kv(value, kv_cache.dtype, _scale(v_scale, kv_cache))
    _bytes(key_slots).index_copy_(0, plan.write_slots, _bytes(key))
    _bytes(value_slots).index_copy_(0, plan.write_slots, _bytes(value))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 for the copies torch has no fp8 kernel for (index_copy_, index_select on CPU)."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


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
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for the batched group -> [num_seqs, max_query_len, num_heads, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    n, max_q, kv_len = group.num_seqs, group.max_query_len, group.padded_kv_len
    gathered_shape = (group.block_ids.numel(), block_size, num_kv_heads, head_dim)
    k_buf = plan.buffer(f"batched_k{group_index}", gathered_shape, kv_cache.dtype, kv_cache.device)
    v_buf = plan.buffer(f"batched_v{group_index}", gathered_shape, kv_cache.dtype, kv_cache.device)
    torch.index_select(_bytes(kv_cache[0]), 0, group.block_ids, out=_bytes(k_buf))
    torch.index_select(_bytes(kv_cache[1]), 0, group.block_ids, out=_bytes(v_buf))
    keys = _read(k_buf, query.dtype, k_scale).view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    values = _read(v_buf, query.dtype, v_scale).view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)

    rows = query if group.query_rows is None else query.index_select(0, group.query_rows)
    queries = rows.view(n, max_q, -1, head_dim).transpose(1, 2)  # [n, heads, max_q, head_dim]
    bias = None if alibi_slopes is None else _alibi_bias(alibi_slopes, group.relative_positions())
    out = _attend(queries, keys, values, partial(group.mask, sliding_window), scale, logits_soft_cap, causal=False,
                  bias=bias)
    return out.transpose(1, 2)


def attend_looped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: LoopedSequence,
    index: int,
    plan: StepPlan,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for one long prefill -> [new tokens, num_heads, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    rows = slice(seq.row_start, seq.row_end)
    causal = seq.is_plain_causal(sliding_window) and key.dtype == kv_cache.dtype
    if causal:
        # Nothing cached before: the new K/V are all there is, no need to read them back.
        keys, values = key[rows], value[rows]
    else:
        gathered_shape = (seq.block_ids.numel(), block_size, num_kv_heads, head_dim)
        k_buf = plan.buffer(f"looped_k{index}", gathered_shape, kv_cache.dtype, kv_cache.device)
        v_buf = plan.buffer(f"looped_v{index}", gathered_shape, kv_cache.dtype, kv_cache.device)
        torch.index_select(_bytes(kv_cache[0]), 0, seq.block_ids, out=_bytes(k_buf))
        torch.index_select(_bytes(kv_cache[1]), 0, seq.block_ids, out=_bytes(v_buf))
        keys = _read(k_buf.view(-1, num_kv_heads, head_dim)[: seq.seq_len], query.dtype, k_scale)
        values = _read(v_buf.view(-1, num_kv_heads, head_dim)[: seq.seq_len], query.dtype, v_scale)
    queries = query[rows].transpose(0, 1).unsqueeze(0)
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)

    bias = None if alibi_slopes is None else _alibi_bias(alibi_slopes, seq.relative_positions())
    out = _attend(queries, keys, values, partial(seq.mask, sliding_window), scale, logits_soft_cap, causal=causal,
                  bias=bias)
    return out[0].transpose(0, 1)


def attend_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    run: DenseRun,
    scale: float,
    logits_soft_cap: float | None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional attention over whole sequences of one length -> [num_seqs * seq_len, heads, head_dim]."""
    n, length = run.num_seqs, run.seq_len
    rows = slice(run.row_start, run.row_start + n * length)
    # through the cache dtype, as if read back from the cache (a no-op when the dtypes agree)
    keys, values = key[rows], value[rows]
    if is_fp8(kv_cache.dtype):
        keys = _read(quantize_kv(keys, kv_cache.dtype, _scale(k_scale, kv_cache)), query.dtype, k_scale)
        values = _read(quantize_kv(values, kv_cache.dtype, _scale(v_scale, kv_cache)), query.dtype, v_scale)
    else:
        keys, values = keys.to(kv_cache.dtype), values.to(kv_cache.dtype)
    keys = keys.view(n, length, key.shape[1], key.shape[2]).transpose(1, 2)
    values = values.view(n, length, value.shape[1], value.shape[2]).transpose(1, 2)
    queries = query[rows].view(n, length, query.shape[1], query.shape[2]).transpose(1, 2)
    bias = None
    if alibi_slopes is not None:
        positions = torch.arange(length, device=query.device)
        bias = _alibi_bias(alibi_slopes, (positions - positions.unsqueeze(-1)).float()[None, None])
    out = _attend(queries, keys, values, None, scale, logits_soft_cap, causal=False, bias=bias)
    return out.transpose(1, 2).reshape(n * length, query.shape[1], query.shape[2])


def _read(cached: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows as attention reads them: fp8 dequantized to the query dtype; others as they are."""
    if not is_fp8(cached.dtype):
        return cached
    if scale is None:
        raise ValueError(f"an fp8 KV cache ({cached.dtype}) needs the layer's k_scale and v_scale")
    return dequantize_kv(cached, dtype, scale)


def _attend(
    queries: torch.Tensor,  # [b, heads, q, head_dim]
    keys: torch.Tensor,  # [b, kv_heads, k, head_dim]
    values: torch.Tensor,
    mask_for: MaskFor | None,  # None (and not causal): every query sees every key
    scale: float,
    logits_soft_cap: float | None,
    causal: bool,
    bias: torch.Tensor | None = None,  # float32 [b, heads, q, k] added to the logits (ALiBi)
) -> torch.Tensor:
    num_heads, num_kv_heads = queries.shape[1], keys.shape[1]
    # SDPA takes a bias only as an attn_mask in the query dtype: ALiBi goes through it in
    # float32 alone (a bf16 bias of -30 would be off by 0.1).
    if logits_soft_cap is None and (bias is None or queries.dtype == torch.float32):
        # SDPA's CPU kernels accumulate half types in float32, so softmax stays float32.
        values = values.to(queries.dtype)
        keys = keys.to(queries.dtype)
        mask = None if causal or mask_for is None else mask_for(queries.dtype)
        if bias is not None:
            if causal:
                mask = _causal_mask(queries.shape[2], keys.shape[2], queries.device)
            mask = bias if mask is None else bias + mask
            causal = False
        return F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    return _attend_explicit(queries, keys, values, mask_for, scale, logits_soft_cap, causal, bias)


def _alibi_bias(slopes: torch.Tensor, relative: torch.Tensor) -> torch.Tensor:
    """[heads] slopes x [b, 1, q, k] key_pos - query_pos -> [b, heads, q, k] float32."""
    return slopes.float().view(1, -1, 1, 1) * relative


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q, k] float32: 0 where key <= query (the queries are the last q of k positions), -inf elsewhere."""
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril_(k_len - q_len)
    return torch.zeros(q_len, k_len, device=device).masked_fill_(~allowed, float("-inf"))


def _attend_explicit(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask_for: MaskFor | None,
    scale: float,
    cap: float | None,
    causal: bool,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Explicit float32 attention, for what SDPA cannot express (the logits soft-cap; ALiBi in half types)."""
    b, num_heads, q_len, head_dim = queries.shape
    num_kv_heads, k_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    # Query heads h*group..(h+1)*group-1 share KV head h: fold them into the row dimension.
    q = queries.float().reshape(b, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2))
    if cap is not None:
        scores.mul_(scale / cap).tanh_().mul_(cap)
    else:
        scores.mul_(scale)
    scores = scores.view(b, num_kv_heads, group, q_len, k_len)
    if bias is not None:
        # query head h = kv_head * group + g: the same fold as the scores'
        scores += bias.view(bias.shape[0], num_kv_heads, group, q_len, k_len)
    if causal:
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril_()
        scores.masked_fill_(~allowed, float("-inf"))
    elif mask_for is not None:
        scores += mask_for(torch.float32).view(b, 1, 1, q_len, k_len)
    probs = torch.softmax(scores, dim=-1).view(b, num_kv_heads, group * q_len, k_len)
    out = torch.matmul(probs, values.float())
    return out.view(b, num_heads, q_len, head_dim).to(queries.dtype)
