"""Gemma, Gemma 2 and Gemma 3 (text) decoders for the engine.

One decoder with per-generation switches (``arch.GemmaOptions``), written for a
flat token batch as the Llama family is: activations are [T, hidden], attention
is core's ``pagoda.layers.RotaryAttention`` (one ``qkv_proj`` matmul, RoPE in place
inside its output, paged ``pagoda.attention.Attention``; soft-capping and sliding
windows are the attention layer's own parameters), and gate/up are one matmul
(``gate_up_proj``).

Gemma's RMSNorm scales by ``1 + weight``. The loader adds the 1 to the weight
once (``GemmaRMSNorm``), so core's ``RMSNorm`` and the platform's fused kernels
serve it unchanged; see ``norm.py`` for what that does to bfloat16 rounding.

Tensor parallelism comes from core's layers: q/k/v and gate/up column-parallel
(heads and the intermediate dim split across ranks, KV heads replicated when
there are fewer than ranks), o_proj and down_proj row-parallel (one all-reduce
each), the vocabulary split in the embedding and the LM head.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RotaryAttention,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    gated_activation,
)
from pagoda.models.interface import SupportsLoRA, SupportsQuant, config_for
from pagoda_models_gemma.arch import GemmaOptions, gemma2_options, gemma3_options, gemma_options, head_dim
from pagoda_models_gemma.norm import GemmaRMSNorm
from pagoda_models_gemma.weights import FUSED_PROJECTIONS, load_gemma_weights


def _attention(cfg: Any, options: GemmaOptions, layer_idx: int, dtype: torch.dtype) -> RotaryAttention:
    total_heads = cfg.num_attention_heads
    dim = head_dim(cfg)
    eps = cfg.rms_norm_eps
    return RotaryAttention(
        cfg.hidden_size, total_heads, getattr(cfg, "num_key_value_heads", None) or total_heads, dim, dtype,
        layer_idx=layer_idx,
        scale=options.attention_scale,
        qkv_bias=options.attention_bias,
        o_proj_bias=options.attention_bias,
        # Gemma 3: (1 + weight) RMSNorm over head_dim on each q and k head, before RoPE
        qk_norm=(lambda heads, total, first: GemmaRMSNorm(dim, eps, dtype)) if options.qk_norm else None,
        sliding_window=options.sliding_windows[layer_idx],
        logits_soft_cap=options.attn_logit_softcapping,
    )


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu(gate(x)) * up(x)), gate and up as one fused projection."""

    def __init__(self, cfg: Any, options: GemmaOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype)
        self.act_fn = gated_activation(options.hidden_activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


class GemmaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP (Gemma); with ``sandwich_norms`` each sublayer's output is normed too (Gemma 2/3)."""

    def __init__(self, cfg: Any, options: GemmaOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rope = options.layer_ropes[layer_idx]
        self.self_attn = _attention(cfg, options, layer_idx, dtype)
        self.mlp = GemmaMLP(cfg, options, dtype)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        # Gemma: the norm before the MLP. Gemma 2/3: the norm on the attention output.
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype) if options.sandwich_norms else None
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype) if options.sandwich_norms else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's output and the residual stream, not yet added (the next norm adds them).

        The residual stream is this model's own tensor (the embedding output, then sums):
        ``add_and_norm`` may write each new sum into it in place.
        """
        normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(normed, cos_sin[self.rope], metadata)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
            return self.mlp(normed), residual
        normed, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: Any, options: GemmaOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # transformers rounds sqrt(hidden_size) to the model dtype before multiplying; so does this.
        self.normalizer = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, options, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary_emb = nn.ModuleDict({name: RotaryEmbedding(rope, dtype) for name, rope in options.ropes.items()})

    def rotary_embeddings(self) -> dict[str, RotaryEmbedding]:
        return {name: cast(RotaryEmbedding, rotary) for name, rotary in self.rotary_emb.items()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids).mul_(self.normalizer)
        # gathered once per step per RoPE table, shared by the layers that use it
        cos_sin = {name: rotary.cos_sin(positions) for name, rotary in self.rotary_embeddings().items()}
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class GemmaForCausalLM(nn.Module, SupportsQuant, SupportsLoRA):
    """The engine-facing model (see ``pagoda.models.interface.CausalLMModel``).

    SupportsQuant: every projection is a core Linear filled through its weight_loader.
    """

    # fused parameter -> the checkpoint projections stacked into it, in row order (vLLM's name)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = FUSED_PROJECTIONS

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config_for(hf_config)
        self.config = cfg
        self.dtype = dtype
        self.options = self.gemma_options(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.model = GemmaModel(cfg, self.options, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, False, dtype)
        if self.tie_word_embeddings:
            # One tensor, two modules: parameters() lists it once, under the embedding's name.
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def gemma_options(cls, cfg: Any) -> GemmaOptions:
        return gemma_options(cfg)

    @property
    def max_positions(self) -> int:
        """Longest context every RoPE table covers; the engine's max_model_len must not exceed it."""
        return min(rotary.max_positions for rotary in self.model.rotary_embeddings().values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.options.final_logit_softcapping
        if cap is not None:
            # cap * tanh(logits / cap), in the order transformers computes it
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_gemma_weights(self, weights)
        if self.tie_word_embeddings:
            # Materialising from the meta device (to_empty) gives each module its own tensor: tie again.
            self.lm_head.weight = self.model.embed_tokens.weight
        return loaded


class Gemma2ForCausalLM(GemmaForCausalLM):
    @classmethod
    def gemma_options(cls, cfg: Any) -> GemmaOptions:
        return gemma2_options(cfg)


class Gemma3ForCausalLM(GemmaForCausalLM):
    @classmethod
    def gemma_options(cls, cfg: Any) -> GemmaOptions:
        return gemma3_options(cfg)
