"""A tiny decoder written for the engine: one attention block, learned positions, no RoPE.

It shows the model contract (``pagoda.models.interface.CausalLMModel``):
- built as ``cls(hf_config, dtype)``;
- ``forward`` takes the flat token batch (all sequences' new tokens, no padding),
  their absolute positions and the step's ``AttentionMetadata``;
- attention goes through ``pagoda.attention.Attention``, whose backend and KV
  cache the model runner binds, so the model has no cache plumbing;
- ``compute_logits`` runs only on the rows that sample;
- ``load_weights`` consumes (checkpoint name, tensor) pairs and says what it loaded.

Reads these config.json fields: vocab_size, hidden_size, num_attention_heads,
num_key_value_heads (optional), intermediate_size, max_position_embeddings,
rms_norm_eps (optional).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata
from pagoda.models.interface import config_for


class ExampleTinyForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config_for(hf_config)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        kv_size = self.num_kv_heads * self.head_dim
        eps = getattr(cfg, "rms_norm_eps", 1e-6)

        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False, dtype=dtype)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_idx=0,
        )
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)
        x = self.attn_norm(hidden)
        hidden = hidden + self.o_proj(self.attn(self.q_proj(x), self.k_proj(x), self.v_proj(x), metadata))
        x = self.mlp_norm(hidden)
        hidden = hidden + self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))
        return self.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            # Checkpoints written by HF-style trainers prefix everything with "model.".
            name = name.removeprefix("model.")
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        return loaded
