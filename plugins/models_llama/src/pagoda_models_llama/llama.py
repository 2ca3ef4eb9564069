"""Llama-style decoder for the engine: Llama, Mistral, Qwen2, Qwen3, Phi-3 and the MoE Mixtral, Qwen2-MoE, Qwen3-MoE.

One decoder with per-architecture switches (``arch.DecoderOptions``); a MoE
architecture's sparse layers use ``pagoda.layers.FusedMoE`` as their MLP. Written
for a flat token batch: activations are [T, hidden], attention goes through
core's ``pagoda.layers.RotaryAttention`` (fused ``qkv_proj``, RoPE in place, paged
``pagoda.attention.Attention``; the runner binds the backend and KV cache).
For CPU speed gate/up are one matmul too (``gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.distributed import get_pp_group
from pagoda.distributed.pipeline import IntermediateTensors, PPMissingLayer, make_layers
from pagoda.layers import (
    FusedMoE,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryAttention,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_config_from_hf,
)
from pagoda.models.interface import (
    NoCudaGraphs,
    SupportsInputsEmbeds,
    SupportsLoRA,
    SupportsOutputRows,
    SupportsPP,
    SupportsQuant,
    config_for,
)
from pagoda_models_llama.arch import (
    DecoderOptions,
    llama_options,
    mistral_options,
    mixtral_options,
    phi3_options,
    qwen2_moe_options,
    qwen2_options,
    qwen3_moe_options,
    qwen3_options,
)
from pagoda_models_llama.weights import FUSED_PROJECTIONS, MIXTRAL_RENAMES, load_llama_weights


def _attention(cfg: Any, options: DecoderOptions, layer_idx: int, dtype: torch.dtype) -> RotaryAttention:
    total_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
    eps = cfg.rms_norm_eps
    return RotaryAttention(
        cfg.hidden_size, total_heads, getattr(cfg, "num_key_value_heads", None) or total_heads, head_dim, dtype,
        layer_idx=layer_idx,
        scale=head_dim**-0.5,
        qkv_bias=options.qkv_bias,
        o_proj_bias=options.o_proj_bias,
        # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
        qk_norm=(lambda heads, total, first: RMSNorm(head_dim, eps, dtype)) if options.qk_norm else None,
        sliding_window=options.sliding_windows[layer_idx],
    )


def _check_activation(cfg: Any) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported by the Llama family (only 'silu')")


def _moe_block(cfg: Any, options: DecoderOptions, dtype: torch.dtype) -> FusedMoE:
    moe = options.moe
    assert moe is not None
    return FusedMoE(
        moe.num_experts,
        moe.top_k,
        cfg.hidden_size,
        moe.intermediate_size,
        renormalize=moe.renormalize,
        hidden_act="silu",
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        dtype=dtype,
    )


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, options: DecoderOptions, dtype: torch.dtype) -> None:
        super().__init__()
        _check_activation(cfg)
        self.intermediate_size = cfg.intermediate_size
        # silu(gate) * up from the projection itself: fused into its matmul where the platform can
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, options.mlp_bias,
                                                       dtype, activation="silu_and_mul")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, options.mlp_bias, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(hidden))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, options: DecoderOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, options, layer_idx, dtype)
        self.mlp: nn.Module
        if options.moe is not None and options.moe.sparse_layers[layer_idx]:
            _check_activation(cfg)
            self.mlp = _moe_block(cfg, options, dtype)
        else:
            self.mlp = LlamaMLP(cfg, options, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's output and the residual stream, not yet added (the next norm adds them).

        The residual stream is this model's own tensor (the embedding output, then sums):
        ``add_and_norm`` may write each new sum into it in place. ``output_rows``: past the attention
        (which still writes every row's K/V), only these rows go on, in this order.
        """
        normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(normed, (cos, sin), metadata)
        if output_rows is not None:
            hidden, residual = hidden.index_select(0, output_rows), residual.index_select(0, output_rows)
        normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, options: DecoderOptions, dtype: torch.dtype) -> None:
        super().__init__()
        # with pipeline parallelism this stage's part only: the embedding on the first, the norm on the last
        pp = get_pp_group()
        self.is_last_stage = pp.is_last_rank
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype) if pp.is_first_rank else PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: LlamaDecoderLayer(cfg, options, i, dtype))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if pp.is_last_rank else PPMissingLayer()
        self.rotary_emb = RotaryEmbedding(rope_config_from_hf(cfg), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None,
                output_rows: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if output_rows is not None and not self.is_last_stage:
            raise ValueError("output_rows: only the last pipeline stage computes the model's output rows")
        cos, sin = self.rotary_emb.cos_sin(positions)  # gathered once per step, shared by all layers
        residual: torch.Tensor | None = None
        if inputs_embeds is not None:  # a multimodal model's: text embeddings with its items' rows written in
            hidden = inputs_embeds
        elif intermediate_tensors is None:
            hidden = self.embed_tokens(input_ids)
        else:  # a later pipeline stage continues the previous one's residual stream
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        layers = self.layers[self.start_layer : self.end_layer]
        for i, layer in enumerate(layers):
            # The last layer needs every row's K/V, but only the output rows past its attention.
            hidden, residual = layer(hidden, residual, cos, sin, metadata, output_rows if i == len(layers) - 1 else None)
        if not self.is_last_stage:
            assert residual is not None  # every stage holds at least one layer
            return IntermediateTensors(hidden_states=hidden, residual=residual)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


def _with_lm_head_from_embedding(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A tied checkpoint's embedding also as ``lm_head.weight`` (for a last pipeline stage without the embedding)."""
    for name, tensor in weights:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


class LlamaForCausalLM(nn.Module, SupportsPP, SupportsQuant, SupportsLoRA, SupportsOutputRows, SupportsInputsEmbeds):
    """The engine-facing model (see ``pagoda.models.interface.CausalLMModel``).

    SupportsPP: make_layers, PPMissingLayer, IntermediateTensors. SupportsQuant: load_weights calls a
    quantization method's weight_loader. SupportsLoRA: every projection is a core linear, q/k/v and
    gate/up packed as ``packed_modules_mapping`` says. SupportsOutputRows: forward(output_rows=...)
    returns only those rows. SupportsInputsEmbeds: forward(inputs_embeds=...) (a multimodal family's decoder).
    """

    # fused parameter -> the checkpoint projections stacked into it, in row order (vLLM's name)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = FUSED_PROJECTIONS
    # (regex, replacement) applied to checkpoint names before they are matched to parameters
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config_for(hf_config)
        self.config = cfg
        self.dtype = dtype
        self.options = self.decoder_options(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = LlamaModel(cfg, self.options, dtype)
        pp = get_pp_group()
        # a tied LM head on a last stage that is not also the first loads its own copy of the embedding
        self.lm_head_from_embedding = self.tie_word_embeddings and pp.is_last_rank and not pp.is_first_rank
        if self.lm_head_from_embedding:
            self.tie_word_embeddings = False
        self.lm_head: nn.Module = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, False, dtype)
                                   if pp.is_last_rank else PPMissingLayer())
        if self.tie_word_embeddings and pp.is_last_rank:
            # One tensor, two modules: parameters() lists it once, under the embedding's name.
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return llama_options(cfg)

    @property
    def max_positions(self) -> int:
        """Longest context the RoPE table covers; the engine's max_model_len must not exceed it."""
        return self.model.rotary_emb.max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None,
                output_rows: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, metadata, intermediate_tensors, output_rows, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] (vLLM's name): what a multimodal model writes its items' embeddings into."""
        return self.model.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        """What a stage receives from the previous one (vLLM's name): the hidden states and the residual."""
        hidden = self.config.hidden_size
        return IntermediateTensors(hidden_states=torch.zeros(num_tokens, hidden, dtype=dtype, device=device),
                                   residual=torch.zeros(num_tokens, hidden, dtype=dtype, device=device))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # In the model dtype: the sampler widens only when it must (not for a greedy argmax).
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.lm_head_from_embedding:
            weights = _with_lm_head_from_embedding(weights)
        loaded = load_llama_weights(self, weights)
        if self.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead):
            # Materialising from the meta device (to_empty) gives each module its own tensor: tie again.
            self.lm_head.weight = self.model.embed_tokens.weight
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return mistral_options(cfg)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return qwen2_options(cfg)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return qwen3_options(cfg)


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint stores qkv_proj and gate_up_proj already fused, as the model does.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return phi3_options(cfg)


class MixtralForCausalLM(LlamaForCausalLM, NoCudaGraphs):  # FusedMoE reads its expert counts on the host
    checkpoint_renames = MIXTRAL_RENAMES

    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return mixtral_options(cfg)


class Qwen2MoeForCausalLM(LlamaForCausalLM, NoCudaGraphs):  # FusedMoE reads its expert counts on the host
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return qwen2_moe_options(cfg)


class Qwen3MoeForCausalLM(LlamaForCausalLM, NoCudaGraphs):  # FusedMoE reads its expert counts on the host
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        return qwen3_moe_options(cfg)
