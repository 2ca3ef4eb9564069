"""Rotary LayerNorm decoders for the engine: GPT-NeoX (Pythia), Phi (1, 1.5, 2) and StableLM.

One decoder with per-architecture switches (``arch.NeoXOptions``): LayerNorm
with bias, RoPE on the first ``partial_rotary_factor`` of each head, and
attention and MLP either one after the other or side by side on the residual
stream (``use_parallel_residual``; Phi always). Written for a flat token batch
as the Llama family is: activations are [T, hidden], q/k/v are one matmul
(``qkv_proj``; GPT-NeoX's checkpoint already fuses them, per head, and the
loader reorders its rows), so are gate/up of a SwiGLU MLP (StableLM), and
attention is core's ``pagoda.layers.RotaryAttention`` (RoPE in place inside the
fused QKV output, the q/k norms as its ``q_norm`` / ``k_norm``, paged
``pagoda.attention.Attention``).

Tensor parallelism comes from core's layers: qkv, fc1 and gate/up
column-parallel (heads and the intermediate dim split across ranks, KV heads
replicated when there are fewer than ranks, a per-head qk-norm holding its
rank's heads), o_proj, fc2 and down_proj row-parallel, the vocabulary split
in the embedding and the LM head.

Parameter names are one scheme for all three architectures (Llama's, plus
``mlp.fc1`` / ``fc2`` for the plain MLP); each architecture's checkpoint names
reach them through its ``checkpoint_renames`` table (``weights.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.layers import (
    Activation,
    ColumnParallelLinear,
    HeadNormFactory,
    LayerNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    PerHeadLayerNorm,
    RotaryAttention,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    gated_activation,
    rope_config_from_hf,
)
from pagoda.model_loader.auto_weights_loader import substitute
from pagoda.models.interface import SupportsQuant, config_for
from pagoda_models_neox.arch import NeoXOptions, gpt_neox_options, phi_options, stablelm_options
from pagoda_models_neox.weights import (
    GATE_UP_PROJ,
    GPT_NEOX_RENAMES,
    PHI_RENAMES,
    QKV_PROJ,
    STABLELM_RENAMES,
    load_neox_weights,
)


def _qk_norm(options: NeoXOptions, eps: float, dtype: torch.dtype) -> HeadNormFactory | None:
    """Phi's norm shared by every head, StableLM's one per head (each rank holding its heads'), or none."""
    if options.qk_norm == "shared":
        return lambda heads, total, first: LayerNorm(options.head_dim, eps, dtype, bias=options.qk_norm_bias)
    if options.qk_norm == "per_head":
        return lambda heads, total, first: PerHeadLayerNorm(heads, options.head_dim, eps, dtype,
                                                            bias=options.qk_norm_bias, total_num_heads=total,
                                                            first_head=first)
    return None


def _attention(cfg: Any, options: NeoXOptions, layer_idx: int, dtype: torch.dtype) -> RotaryAttention:
    return RotaryAttention(
        cfg.hidden_size, cfg.num_attention_heads, options.num_kv_heads, options.head_dim, dtype,
        layer_idx=layer_idx,
        scale=options.head_dim**-0.5,
        qkv_bias=options.qkv_bias,
        o_proj_bias=options.o_proj_bias,
        qk_norm=_qk_norm(options, cfg.layer_norm_eps, dtype),
    )


class NeoXMLP(nn.Module):
    """fc2(act(fc1(x))): GPT-NeoX's dense_h_to_4h / dense_4h_to_h and Phi's fc1 / fc2."""

    def __init__(self, cfg: Any, options: NeoXOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, options.mlp_bias, dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, options.mlp_bias, dtype)
        self.act = Activation(options.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one projection (StableLM's SwiGLU)."""

    def __init__(self, cfg: Any, options: NeoXOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, options.mlp_bias,
                                                       dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, options.mlp_bias, dtype)
        self.act_fn = gated_activation(options.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


class NeoXDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, options: NeoXOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.layer_norm_eps
        self.residual = options.residual
        self.self_attn = _attention(cfg, options, layer_idx, dtype)
        self.mlp = NeoXMLP(cfg, options, dtype) if options.mlp == "plain" else GatedMLP(cfg, options, dtype)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps, dtype)
        # the MLP's own norm; with a shared norm the MLP reads input_layernorm's output
        shared = options.residual == "parallel_shared_norm"
        self.post_attention_layernorm = None if shared else LayerNorm(cfg.hidden_size, eps, dtype)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, (cos, sin), metadata)
        if self.residual == "sequential":
            assert self.post_attention_layernorm is not None
            hidden = attn.add_(hidden)
            return self.mlp(self.post_attention_layernorm(hidden)).add_(hidden)
        mlp_in = normed if self.post_attention_layernorm is None else self.post_attention_layernorm(hidden)
        # (attn + mlp) + hidden: transformers' order for GPT-NeoX and Phi (StableLM adds hidden first)
        return attn.add_(self.mlp(mlp_in)).add_(hidden)


class NeoXModel(nn.Module):
    def __init__(self, cfg: Any, options: NeoXOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(NeoXDecoderLayer(cfg, options, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(rope_config_from_hf(cfg), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)  # gathered once per step, shared by all layers
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, metadata)
        return self.norm(hidden)


class NeoXFamilyForCausalLM(nn.Module, SupportsQuant):
    """The engine-facing model (see ``pagoda.models.interface.CausalLMModel``); subclasses name the architecture.

    SupportsQuant: every projection is a core Linear filled through its weight_loader.
    """

    # fused parameter -> the checkpoint projections stacked into it, in row order (vLLM's name)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    # (checkpoint part, model part) from checkpoint names to this model's parameter names (pagoda.model_loader.auto_weights_loader.substitute)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config_for(hf_config)
        self.config = cfg
        self.dtype = dtype
        self.options = self.decoder_options(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = NeoXModel(cfg, self.options, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.options.lm_head_bias, dtype)
        if self.tie_word_embeddings:
            # One tensor, two modules: parameters() lists it once, under the embedding's name.
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_options(cls, cfg: Any) -> NeoXOptions:
        raise NotImplementedError(f"{cls.__name__} names no architecture; use one of its subclasses")

    @property
    def max_positions(self) -> int:
        """Longest context the RoPE table covers; the engine's max_model_len must not exceed it."""
        return self.model.rotary_emb.max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # In the model dtype: the sampler widens only when it must (not for a greedy argmax).
        return self.lm_head(hidden_states)

    def map_checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name under this model's parameter names (the GGUF loader's filter asks too)."""
        return substitute(name, self.checkpoint_renames)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (under this model's parameter name) in the layout the parameter has."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_neox_weights(self, weights)
        if self.tie_word_embeddings:
            # Materialising from the meta device (to_empty) gives each module its own tensor: tie again.
            self.lm_head.weight = self.model.embed_tokens.weight
        return loaded


class GPTNeoXForCausalLM(NeoXFamilyForCausalLM):
    checkpoint_renames = GPT_NEOX_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any) -> NeoXOptions:
        return gpt_neox_options(cfg)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """GPT-NeoX's fused query_key_value rows are [heads, 3, head_dim] (q, k, v of head 0, then head 1 ...).

        transformers views the output as [T, heads, 3 * head_dim] and splits each head's slice in three;
        the model wants all q rows, then all k, then all v ([3, heads, head_dim]) so q, k and v are
        contiguous column blocks of the matmul output.
        """
        if ".self_attn.qkv_proj." not in name:
            return tensor
        heads, head_dim = self.config.num_attention_heads, self.options.head_dim
        # every per-output-row tensor of the layer moves with its row: the weight and bias, and a
        # quantized checkpoint's int8 weight and its per-channel weight_scale (a per-tensor scale
        # or a weight_shape has no such rows)
        if tensor.ndim == 0 or tensor.shape[0] != 3 * heads * head_dim:
            return tensor  # the loader reports the shape mismatch by name
        rest = tuple(tensor.shape[1:])
        return tensor.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)


class PhiForCausalLM(NeoXFamilyForCausalLM):
    packed_modules_mapping = QKV_PROJ
    checkpoint_renames = PHI_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any) -> NeoXOptions:
        return phi_options(cfg)


class StableLmForCausalLM(NeoXFamilyForCausalLM):
    packed_modules_mapping = {**QKV_PROJ, **GATE_UP_PROJ}
    checkpoint_renames = STABLELM_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any) -> NeoXOptions:
        return stablelm_options(cfg)
