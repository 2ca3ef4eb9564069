"""The self-attention block the decoder families share: fused q/k/v projection, optional q/k norm, RoPE, paged
attention, output projection.

The Llama, Gemma, NeoX and GPT families configure it (head counts and size, biases, the norm, the
sliding window, the soft cap, the scale, ALiBi slopes); the block is theirs to call with the step's
RoPE ``(cos, sin)`` (None: no rotation, for learned positions or ALiBi). q, k and v are one matmul
(``qkv_proj``); RoPE rotates q and k in place inside its output, so they reach the attention layer as
strided views of it. Parameter names (``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``) are vLLM's.

With tensor parallelism the projections split the heads across ranks (``QKVParallelLinear`` /
``RowParallelLinear``; KV heads replicated when there are fewer than ranks); the q/k norm factory is
told which heads this rank holds, and ALiBi slopes are sliced to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata
from pagoda.distributed import get_tensor_model_parallel_rank
from pagoda.layers.ops import LayerOpsModule
from pagoda.layers.parallel_linear import QKVParallelLinear, RowParallelLinear

# (heads on this rank, heads in the model, this rank's first head) -> the norm over each of those
# heads' head_dim channels (a norm shared by every head ignores the three)
HeadNormFactory = Callable[[int, int, int], nn.Module]


class RotaryAttention(LayerOpsModule):  # self.ops rotates q and k
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        layer_idx: int,
        scale: float,
        qkv_bias: bool = False,
        o_proj_bias: bool = False,
        qk_norm: HeadNormFactory | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        alibi_slopes: Sequence[float] | None = None,
    ) -> None:
        """``num_heads`` / ``num_kv_heads``: the model's (this rank holds its share); ``qk_norm``: a norm over
        each q and each k head before RoPE (Qwen3, Gemma 3, Phi, StableLM); ``alibi_slopes``: one per head
        of the model (Falcon with ALiBi)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_proj_bias, dtype)
        rank = get_tensor_model_parallel_rank()
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            kv_rank = rank // self.qkv_proj.num_kv_head_replicas  # ranks sharing a KV head hold the same one
            self.q_norm = qk_norm(self.num_heads, num_heads, rank * self.num_heads)
            self.k_norm = qk_norm(self.num_kv_heads, num_kv_heads, kv_rank * self.num_kv_heads)
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes[rank * self.num_heads : (rank + 1) * self.num_heads]
        self.attn = Attention(
            num_heads=self.num_heads,
            head_dim=head_dim,
            scale=scale,
            num_kv_heads=self.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            layer_idx=layer_idx,
            alibi_slopes=alibi_slopes,
        )

    def forward(
        self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k heads side by side: one norm and one rotation call each cover both
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_heads, k_heads = qk[:, : self.num_heads], qk[:, self.num_heads :]
            q_heads.copy_(self.q_norm(q_heads))
            k_heads.copy_(self.k_norm(k_heads))
        if cos_sin is not None:
            self.ops.rotary_neox_(qk, *cos_sin)  # only the first rotary_dim channels of each head turn
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        return self.o_proj(self.attn(q, k, v, metadata))
