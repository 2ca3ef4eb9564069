"""A tiny decoder written for the engine: one attention block, learned positions, no RoPE.

It shows the model contract (``pagoda.models.interface.CausalLMModel``):
- built as ``cls(hf_config, dtype)``, parameters allocated with ``torch.empty``
  (``load_weights`` overwrites every one);
- ``forward`` takes the flat token batch (all sequences' new tokens, no padding),
  their absolute positions and the step's ``AttentionMetadata``;
- layers come from ``pagoda.layers`` (``Linear``, ``RMSNorm``, ``Embedding``,
  ``Activation``), so the platform's fast matmul and norm kernels serve it;
  q, k and v are one fused ``Linear`` (``qkv_proj``), one matmul per step;
- attention goes through ``pagoda.attention.Attention``, whose backend and KV
  cache the model runner binds, so the model has no cache plumbing;
- ``compute_logits`` runs only on the rows that sample;
- ``load_weights`` maps checkpoint names onto parameters through one table
  (``STACKED_PARAMS``), and raises on an unknown, misshapen or missing weight.

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
from pagoda.layers import Activation, Embedding, Linear, RMSNorm
from pagoda.models.interface import config_for

# checkpoint projection -> (fused parameter, shard index): q, k and v are stacked
# row-wise into qkv_proj (vLLM calls this table stacked_params_mapping).
STACKED_PARAMS: dict[str, tuple[str, int]] = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


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
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        hidden = cfg.hidden_size

        self.embed_tokens = Embedding(cfg.vocab_size, hidden, dtype)
        self.embed_positions = Embedding(cfg.max_position_embeddings, hidden, dtype)
        self.attn_norm = RMSNorm(hidden, eps, dtype)
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, False, dtype)
        self.o_proj = Linear(self.q_size, hidden, False, dtype)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_idx=0,
        )
        self.mlp_norm = RMSNorm(hidden, eps, dtype)
        self.up_proj = Linear(hidden, cfg.intermediate_size, False, dtype)
        self.act = Activation(getattr(cfg, "hidden_act", "gelu"))
        self.down_proj = Linear(cfg.intermediate_size, hidden, False, dtype)
        self.norm = RMSNorm(hidden, eps, dtype)
        self.lm_head = Linear(hidden, cfg.vocab_size, False, dtype)

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
        params = dict(self.named_parameters())
        # rows of each shard inside the fused parameter: q, then k, then v
        shard_rows = [(0, self.q_size), (self.q_size, self.kv_size), (self.q_size + self.kv_size, self.kv_size)]
        loaded: set[str] = set()  # parameter names, as the checkpoint spells them without "model."
        consumed: set[str] = set()
        for checkpoint_name, tensor in weights:
            # Checkpoints written by HF-style trainers prefix the body with "model.".
            name = checkpoint_name.removeprefix("model.")
            module, _, leaf = name.rpartition(".")
            target, rows = name, None
            if module in STACKED_PARAMS:
                fused, shard = STACKED_PARAMS[module]
                target, rows = f"{fused}.{leaf}", shard_rows[shard]
            if target not in params:
                raise ValueError(f"unexpected weight {checkpoint_name!r} for {type(self).__name__}")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {checkpoint_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(param.dtype))
            loaded.add(name)
            consumed.add(checkpoint_name)
        # every parameter, in the checkpoint's names (a fused one as its shards)
        fused_targets = {f"{fused}.weight" for fused, _ in STACKED_PARAMS.values()}
        expected = {n for n in params if n not in fused_targets} | {f"{m}.weight" for m in STACKED_PARAMS}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"{type(self).__name__}: the checkpoint lacks {', '.join(missing)}")
        return consumed
