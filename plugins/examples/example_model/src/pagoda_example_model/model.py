"""A tiny decoder written for the engine: one attention block, learned positions, no RoPE.

It shows the model contract (``pagoda.models.interface.CausalLMModel``):
- built as ``cls(hf_config, dtype)``, parameters allocated with ``torch.empty``
  (``load_weights`` overwrites every one);
- ``forward`` takes the flat token batch (all sequences' new tokens, no padding),
  their absolute positions and the step's ``AttentionMetadata``;
- layers come from ``pagoda.layers`` (the parallel ``Linear`` subclasses,
  ``VocabParallelEmbedding``, ``ParallelLMHead``, ``RMSNorm``, ``Activation``),
  so the platform's fast matmul and norm kernels serve it and
  ``tensor_parallel_size > 1`` splits it across ranks with no code here;
  q, k and v are one fused ``QKVParallelLinear`` (``qkv_proj``), one matmul per step;
- attention goes through ``pagoda.attention.Attention``, whose backend and KV
  cache the model runner binds, so the model has no cache plumbing;
- ``compute_logits`` runs only on the rows that sample;
- ``load_weights`` hands the checkpoint to core's ``AutoWeightsLoader`` with one
  table (``packed_modules_mapping``); it raises on an unknown, misshapen or
  missing weight.

Reads these config.json fields: vocab_size, hidden_size, num_attention_heads,
num_key_value_heads (optional), intermediate_size, max_position_embeddings,
rms_norm_eps (optional), hidden_act (optional, default "gelu").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata
from pagoda.layers import (
    Activation,
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader
from pagoda.models.interface import config_for


class ExampleTinyForCausalLM(nn.Module):
    # fused parameter -> the checkpoint projections stacked row-wise into it (vLLM's packed_modules_mapping)
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config_for(hf_config)
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = cfg.hidden_size // total_heads
        if total_heads % total_kv_heads:
            raise ValueError(
                f"num_attention_heads={total_heads} is not a multiple of num_key_value_heads={total_kv_heads}"
            )
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        hidden = cfg.hidden_size

        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden, dtype)
        self.embed_positions = VocabParallelEmbedding(cfg.max_position_embeddings, hidden, dtype)
        self.attn_norm = RMSNorm(hidden, eps, dtype)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, False, dtype)
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, False, dtype)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_idx=0,
        )
        self.mlp_norm = RMSNorm(hidden, eps, dtype)
        self.up_proj = ColumnParallelLinear(hidden, cfg.intermediate_size, False, dtype)
        self.act = Activation(getattr(cfg, "hidden_act", "gelu"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, hidden, False, dtype)
        self.norm = RMSNorm(hidden, eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, hidden, False, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)
        qkv = self.qkv_proj(self.attn_norm(hidden))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        hidden = hidden + self.o_proj(self.attn(q, k, v, metadata))
        hidden = hidden + self.down_proj(self.act(self.up_proj(self.mlp_norm(hidden))))
        return self.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Checkpoints written by HF-style trainers prefix the body with "model.".
        return AutoWeightsLoader(
            self,
            packed_modules_mapping=self.packed_modules_mapping,
            name_mapper=lambda name: name.removeprefix("model."),
            inverse_name_mapper=lambda name: f"model.{name}",
        ).load_weights(weights)
