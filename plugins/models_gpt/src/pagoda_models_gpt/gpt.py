"""LayerNorm decoders with learned absolute positions, rotary or ALiBi, for the engine: GPT-2, OPT and Falcon.

One decoder with per-architecture switches (``arch.GPTOptions``). Written for a
flat token batch as the Llama family is: activations are [T, hidden], q/k/v
are one matmul (``qkv_proj``: GPT-2's and Falcon's checkpoints fuse them
already, OPT's are stacked at load), attention is core's
``pagoda.layers.RotaryAttention`` (paged ``pagoda.attention.Attention``). Positions
enter in one of three ways:

* learned (GPT-2, OPT): ``model.embed_positions`` (core's ``Embedding``) is
  added to the token embeddings; OPT's table is read ``position + 2``;
* rotary (Falcon): RoPE rotates q and k in place inside the fused QKV output;
* ALiBi (Falcon ``alibi=True``): no rotation; the attention layer carries the
  slopes and the backend adds ``slope * (key_pos - query_pos)`` to the logits.

Tensor parallelism comes from core's layers: qkv and fc1 column-parallel
(heads and the MLP width split across ranks, KV heads replicated when there are
fewer than ranks: Falcon's multi-query), o_proj and fc2 row-parallel, the
vocabulary split in the embedding and the LM head, the learned position table
split as a vocabulary too (vLLM's GPT-2 does the same), OPT's project_in /
project_out replicated; each rank's attention gets its heads' ALiBi slopes.

Parameter names are one scheme for the three architectures; each
checkpoint's names reach them through its ``checkpoint_renames`` table
(``weights.py``).
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
    LayerNorm,
    ParallelLMHead,
    ReplicatedLinear,
    RotaryAttention,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_config_from_hf,
)
from pagoda.model_loader.auto_weights_loader import substitute
from pagoda.models.interface import SupportsLoRA, SupportsQuant, config_for
from pagoda_models_gpt.arch import GPTOptions, falcon_options, gpt2_options, opt_options
from pagoda_models_gpt.weights import (
    FALCON_RENAMES,
    FALCON_TWO_NORM_RENAMES,
    GPT2_RENAMES,
    OPT_RENAMES,
    QKV_PROJ,
    load_gpt_weights,
    regroup_fused_qkv,
)

# (cos, sin) gathered once per step for rotary models; None for learned positions and ALiBi
CosSin = tuple[torch.Tensor, torch.Tensor] | None


def _attention(cfg: Any, options: GPTOptions, layer_idx: int, dtype: torch.dtype) -> RotaryAttention:
    return RotaryAttention(
        cfg.hidden_size, options.num_heads, options.num_kv_heads, options.head_dim, dtype,
        layer_idx=layer_idx,
        scale=options.attention_scales[layer_idx],
        qkv_bias=options.qkv_bias,
        o_proj_bias=options.o_proj_bias,
        alibi_slopes=options.alibi_slopes,
    )


class GPTMLP(nn.Module):
    """fc2(act(fc1(x))): GPT-2's c_fc / c_proj, OPT's fc1 / fc2, Falcon's dense_h_to_4h / dense_4h_to_h."""

    def __init__(self, cfg: Any, options: GPTOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, options.intermediate_size, options.mlp_bias, dtype)
        self.fc2 = RowParallelLinear(options.intermediate_size, cfg.hidden_size, options.mlp_bias, dtype)
        self.act = Activation(options.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class GPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, options: GPTOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = options.layer_norm_eps
        self.residual = options.residual
        self.self_attn = _attention(cfg, options, layer_idx, dtype)
        self.mlp = GPTMLP(cfg, options, dtype)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps, dtype)
        # the MLP's own norm; with a shared norm the MLP reads input_layernorm's output
        shared = options.residual == "parallel_shared_norm"
        self.post_attention_layernorm = None if shared else LayerNorm(cfg.hidden_size, eps, dtype)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, metadata: AttentionMetadata) -> torch.Tensor:
        if self.residual == "post_norm":
            assert self.post_attention_layernorm is not None
            hidden = self.input_layernorm(self.self_attn(hidden, cos_sin, metadata).add_(hidden))
            return self.post_attention_layernorm(self.mlp(hidden).add_(hidden))
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, cos_sin, metadata)
        if self.residual == "pre_norm":
            assert self.post_attention_layernorm is not None
            hidden = attn.add_(hidden)
            return self.mlp(self.post_attention_layernorm(hidden)).add_(hidden)
        mlp_in = normed if self.post_attention_layernorm is None else self.post_attention_layernorm(hidden)
        # (mlp + attn) + hidden: Falcon's order
        return self.mlp(mlp_in).add_(attn).add_(hidden)


class GPTModel(nn.Module):
    def __init__(self, cfg: Any, options: GPTOptions, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        embed_dim = options.embed_dim or hidden
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, embed_dim, dtype)
        # OPT's word_embed_proj_dim: embeddings narrower than the decoder, projected in and out
        self.project_in = ReplicatedLinear(embed_dim, hidden, False, dtype) if options.embed_dim else None
        self.project_out = ReplicatedLinear(hidden, embed_dim, False, dtype) if options.embed_dim else None
        self.position_offset = options.position_offset
        self.embed_positions = (
            VocabParallelEmbedding(options.max_position_embeddings + options.position_offset, hidden, dtype)
            if options.positions == "learned"
            else None
        )
        self.rotary_emb = RotaryEmbedding(rope_config_from_hf(cfg), dtype) if options.positions == "rotary" else None
        self.layers = nn.ModuleList(GPTDecoderLayer(cfg, options, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = LayerNorm(hidden, options.layer_norm_eps, dtype) if options.final_norm else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        if self.embed_positions is not None:
            offset = positions + self.position_offset if self.position_offset else positions
            hidden = hidden + self.embed_positions(offset)
        # gathered once per step, shared by all layers
        cos_sin = self.rotary_emb.cos_sin(positions) if self.rotary_emb is not None else None
        for layer in self.layers:
            hidden = layer(hidden, cos_sin, metadata)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class GPTFamilyForCausalLM(nn.Module, SupportsQuant):
    """The engine-facing model (see ``pagoda.models.interface.CausalLMModel``); subclasses name the architecture.

    SupportsQuant: every projection is a core Linear filled through its weight_loader (GPT-2 says why not).
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
        self.options = self.decoder_options(cfg, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.model = GPTModel(cfg, self.options, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, self.options.embed_dim or cfg.hidden_size, False, dtype)
        if self.tie_word_embeddings:
            # One tensor, two modules: parameters() lists it once, under the embedding's name.
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_options(cls, cfg: Any, dtype: torch.dtype) -> GPTOptions:
        raise NotImplementedError(f"{cls.__name__} names no architecture; use one of its subclasses")

    @property
    def max_positions(self) -> int:
        """Longest context the position table (learned) or the RoPE table covers; ALiBi has no bound
        of its own, the config's max_position_embeddings is what the model was trained on."""
        if self.model.rotary_emb is not None:
            return self.model.rotary_emb.max_positions
        return self.options.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # In the model dtype: the sampler widens only when it must (not for a greedy argmax).
        return self.lm_head(hidden_states)

    def normalize_checkpoint_name(self, name: str) -> str:
        """A checkpoint name under transformers' causal-LM prefix (base-model checkpoints lack it)."""
        return name

    def map_checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name under this model's parameter names (the GGUF loader's filter asks too)."""
        return substitute(self.normalize_checkpoint_name(name), self.checkpoint_renames)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (under this model's parameter name) in the layout the parameter has."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_gpt_weights(self, weights)
        if self.tie_word_embeddings:
            # Materialising from the meta device (to_empty) gives each module its own tensor: tie again.
            self.lm_head.weight = self.model.embed_tokens.weight
        return loaded


# GPT-2's Conv1D modules store weights as [in, out]
_GPT2_CONV1D = (".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight")


# SupportsLoRA: GPT-2's and OPT's checkpoint rows are the model's rows (Falcon's fused q/k/v are regrouped at
# load, which an adapter's B would need too: not declared there)
class GPT2LMHeadModel(GPTFamilyForCausalLM, SupportsLoRA):
    checkpoint_renames = GPT2_RENAMES
    # Quantizers target nn.Linear (compressed-tensors' "Linear", GPTQ, AWQ): GPT-2's Conv1D projections are
    # none, so no quantized GPT-2 layout is in use to be read; the [in, out] transpose below would also
    # have to know each method's packing. Refused by name rather than guessed.
    quant_unsupported_reason = (
        "GPT-2's projections are transformers Conv1D layers ([in, out] weights), not nn.Linear: quantized "
        "checkpoints have no layout for them that pagoda reads"
    )

    @classmethod
    def decoder_options(cls, cfg: Any, dtype: torch.dtype) -> GPTOptions:
        return gpt2_options(cfg, dtype)

    def normalize_checkpoint_name(self, name: str) -> str:
        # openai-community/gpt2 and friends are saved from GPT2Model: "h.0.attn.c_attn.weight", "wte.weight"
        return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if name.endswith(_GPT2_CONV1D) and tensor.ndim == 2 else tensor


class OPTForCausalLM(GPTFamilyForCausalLM, SupportsLoRA):
    packed_modules_mapping = QKV_PROJ
    checkpoint_renames = OPT_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any, dtype: torch.dtype) -> GPTOptions:
        return opt_options(cfg, dtype)

    def normalize_checkpoint_name(self, name: str) -> str:
        # facebook/opt-* are saved from OPTModel: "decoder.layers.0.fc1.weight"
        return f"model.{name}" if name.startswith("decoder.") else name


class FalconForCausalLM(GPTFamilyForCausalLM):
    checkpoint_renames = FALCON_RENAMES

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        if self.options.residual == "parallel_two_norms":
            self.checkpoint_renames = FALCON_RENAMES + FALCON_TWO_NORM_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any, dtype: torch.dtype) -> GPTOptions:
        return falcon_options(cfg, dtype)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".self_attn.qkv_proj." not in name:
            return tensor
        o = self.options
        # every per-output-row tensor of the layer moves with its row: the weight and bias, and a
        # quantized checkpoint's int8 weight and its per-channel weight_scale (a per-tensor scale
        # or a weight_shape has no such rows)
        if tensor.ndim == 0 or tensor.shape[0] != (o.num_heads + 2 * o.num_kv_heads) * o.head_dim:
            return tensor  # the loader reports the shape mismatch by name
        return regroup_fused_qkv(tensor, o.qkv_layout, o.num_heads, o.num_kv_heads, o.head_dim)
