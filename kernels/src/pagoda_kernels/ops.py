"""The kernels as torch custom ops (``torch.ops.pagoda_kernels.*``), for torch.compile and CUDA graphs.

Importing this module registers them; each op dispatches like the Python
function of the same name (Triton on GPUs, the torch reference elsewhere) and
has a fake (meta) implementation so graphs can be traced without running it.
"""

from __future__ import annotations

import torch

from pagoda_kernels import activation as _activation
from pagoda_kernels import attention as _attention
from pagoda_kernels import kv_cache as _kv_cache
from pagoda_kernels import norm as _norm
from pagoda_kernels import rotary as _rotary

NAMESPACE = "pagoda_kernels"


@torch.library.custom_op(f"{NAMESPACE}::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _kv_cache.reshape_and_cache(key, value, kv_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    return _attention.paged_decode_attention(
        query, kv_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, max_seq_len, num_splits
    )


@paged_decode_attention.register_fake
def _(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(query)


@torch.library.custom_op(f"{NAMESPACE}::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    return _attention.paged_prefill_attention(
        query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, soft_cap, max_query_len
    )


@paged_prefill_attention.register_fake
def _(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(query)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotary.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


@rotary_embedding.register_fake
def _(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key)


@torch.library.custom_op(f"{NAMESPACE}::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _activation.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
