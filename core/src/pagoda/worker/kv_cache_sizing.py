"""How many KV cache blocks a rank gets: the bytes one block takes, the budget, and the rules on top.

The model runner asks three things in turn: what a block costs (``KVCacheLayout``), how many bytes
the cache may take (an explicit ``num_kv_blocks`` / ``num_blocks`` from the ranks, else the
platform's ``kv_cache_budget_bytes``), and whether that holds one ``max_model_len`` request.
A pooling model holds blocks for one step only, so its default is cut to a step's worth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.attention import AttentionSpec
    from pagoda.config import EngineConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheLayout:
    """What one block of the cache holds: ``block_size`` tokens' keys and values in every attention layer."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    num_layers: int

    @classmethod
    def of(cls, spec: AttentionSpec, num_layers: int) -> KVCacheLayout:
        element_bytes = torch.empty((), dtype=spec.cache_dtype).element_size()
        return cls(spec.block_size, spec.num_kv_heads, spec.head_dim, element_bytes, num_layers)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes * self.num_layers

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.block_size)


def pooling_num_blocks(num_blocks: int, layout: KVCacheLayout, max_num_batched_tokens: int, max_num_seqs: int,
                       max_model_len: int) -> int:
    """A pooling request holds its blocks for its one step only: one full step's worth is all that is used."""
    step_blocks = layout.blocks_for(max_num_batched_tokens) + max_num_seqs
    return min(num_blocks, max(step_blocks, layout.blocks_for(max_model_len)))


def check_holds_one_request(num_blocks: int, layout: KVCacheLayout, max_model_len: int) -> None:
    """Refuse a cache that cannot hold one ``max_model_len`` request (it could never finish one)."""
    needed = layout.blocks_for(max_model_len)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget holds {num_blocks} blocks ({num_blocks * layout.block_size} tokens) but one "
            f"max_model_len={max_model_len} request needs {needed} blocks ({needed * layout.bytes_per_block} bytes); "
            "raise kv_cache_memory_bytes / PAGODA_CPU_KVCACHE_SPACE / num_kv_blocks or lower max_model_len"
        )


def request_bytes_upper_bound(config: EngineConfig) -> int:
    """At least the KV bytes one ``max_model_len`` request takes, from the model's config alone (no model loaded).

    Every decoder layer counted as an attention layer and the unsharded KV heads: never less than the
    runner's own figure, which counts the attention layers it finds and this rank's heads. A platform
    whose default budget follows the model keeps it at least this large, so the default never refuses
    a request length the model takes.
    """
    from pagoda.attention.kv_quant import resolve_kv_cache_dtype

    resolved = config.resolved
    text = resolved.text_config
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layers = int(getattr(text, "num_hidden_layers", 1) or 1)
    dtype = resolve_kv_cache_dtype(config.cache_config.cache_dtype, resolved.dtype)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    block_size = config.cache_config.block_size or 16
    blocks = cdiv(resolved.max_model_len, block_size)
    return blocks * 2 * block_size * kv_heads * head_dim * element_bytes * layers
