"""How GPT-2, OPT and Falcon differ, read off their Hugging Face configs.

All three are LayerNorm decoders with a plain MLP (``fc2(act(fc1(x)))``). They
differ in where positions come from (a learned table added to the embeddings,
rotary q/k, or an ALiBi bias in attention), where the norms sit on the
residual stream, their biases, and how their checkpoints fuse q, k and v.
Config options this family cannot honour raise ``ValueError`` here, before any
weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from pagoda.layers import get_alibi_slopes

# learned: a [positions, hidden] table added to the token embeddings (GPT-2, OPT);
# rotary: RoPE on q and k (Falcon); alibi: a per-head linear bias in attention (Falcon alibi=True)
Positions = Literal["learned", "rotary", "alibi"]
# pre_norm:             h = h + attn(ln1(h)); h = h + mlp(ln2(h))        (GPT-2, OPT, Falcon parallel_attn=False)
# post_norm:            h = ln1(h + attn(h)); h = ln2(h + mlp(h))        (OPT do_layer_norm_before=False, OPT-350m)
# parallel_shared_norm: n = ln1(h); h = (mlp(n) + attn(n)) + h           (Falcon-7B style parallel_attn)
# parallel_two_norms:   h = (mlp(ln2(h)) + attn(ln1(h))) + h             (Falcon new_decoder_architecture)
Residual = Literal["pre_norm", "post_norm", "parallel_shared_norm", "parallel_two_norms"]
# How the checkpoint's fused query_key_value rows are ordered (the model wants [all q; all k; all v]):
# blocks: already so (GPT-2's c_attn, Falcon multi_query); per_head: [heads, 3, head_dim] (Falcon MHA);
# per_kv_group: [kv_heads, heads_per_kv + 2, head_dim], a group's queries then its k and v (Falcon new arch)
QKVLayout = Literal["blocks", "per_head", "per_kv_group"]


@dataclass(frozen=True)
class GPTOptions:
    """The per-architecture switches of the shared decoder."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    positions: Positions
    residual: Residual
    final_norm: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # one softmax scale per layer (GPT-2's scale_attn_by_inverse_layer_idx divides by layer + 1)
    attention_scales: tuple[float, ...]
    qkv_layout: QKVLayout = "blocks"
    # learned positions: table row of position p is p + offset (OPT's table starts 2 rows in)
    position_offset: int = 0
    max_position_embeddings: int = 0
    # token embedding width when it differs from hidden_size (OPT's word_embed_proj_dim: project_in / _out)
    embed_dim: int | None = None
    # ALiBi: one slope per head, already scaled as the model applies them
    alibi_slopes: tuple[float, ...] | None = None


def gpt2_options(cfg: Any, dtype: torch.dtype = torch.float32) -> GPTOptions:
    """GPT-2: pre-norm, learned positions, biases everywhere, tied LM head (checkpoint: Conv1D, [in, out])."""
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder's decoder) is not supported")
    if getattr(cfg, "reorder_and_upcast_attn", False) and dtype != torch.float32:
        # In float32 the upcast is the identity; in half types transformers computes q.k and the softmax
        # in float32 with the scale folded in first, an order no backend here promises to keep.
        raise ValueError(
            f"GPT-2 with reorder_and_upcast_attn=True is supported in float32 only (requested {dtype}); "
            "load the model with dtype='float32'"
        )
    heads = int(cfg.num_attention_heads)
    head_dim = int(cfg.hidden_size) // heads
    base = head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
    by_layer = bool(getattr(cfg, "scale_attn_by_inverse_layer_idx", False))
    layers = int(cfg.num_hidden_layers)
    return GPTOptions(
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=int(cfg.n_inner or 4 * cfg.hidden_size),
        hidden_act=cfg.activation_function,
        layer_norm_eps=float(cfg.layer_norm_epsilon),
        positions="learned",
        residual="pre_norm",
        final_norm=True,
        qkv_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        attention_scales=tuple(base / (i + 1) if by_layer else base for i in range(layers)),
        max_position_embeddings=int(cfg.max_position_embeddings),
    )


# OPT's learned position table starts 2 rows in (a fairseq padding_idx convention)
OPT_POSITION_OFFSET = 2


def opt_options(cfg: Any, dtype: torch.dtype = torch.float32) -> GPTOptions:
    """OPT: learned positions offset by 2, pre- or post-norm (``do_layer_norm_before``), optional
    project_in / project_out around the decoder (``word_embed_proj_dim``), ReLU by default."""
    if not getattr(cfg, "layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=False (norms without weights) is not supported")
    heads = int(cfg.num_attention_heads)
    head_dim = int(cfg.hidden_size) // heads
    if head_dim * heads != cfg.hidden_size:
        raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={heads}")
    pre_norm = bool(getattr(cfg, "do_layer_norm_before", True))
    bias = bool(getattr(cfg, "enable_bias", True))
    embed_dim = int(getattr(cfg, "word_embed_proj_dim", None) or cfg.hidden_size)
    return GPTOptions(
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=int(cfg.ffn_dim),
        hidden_act=cfg.activation_function,
        layer_norm_eps=1e-5,  # OPT's nn.LayerNorm default; the config has no epsilon
        positions="learned",
        residual="pre_norm" if pre_norm else "post_norm",
        final_norm=pre_norm and not getattr(cfg, "_remove_final_layer_norm", False),
        qkv_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bias,
        # transformers scales q before q.k (q_proj(x) * scaling, then scale 1.0): the same product
        # up to float rounding, as vLLM computes it
        attention_scales=(head_dim**-0.5,) * int(cfg.num_hidden_layers),
        position_offset=OPT_POSITION_OFFSET,
        max_position_embeddings=int(cfg.max_position_embeddings),
        embed_dim=embed_dim if embed_dim != cfg.hidden_size else None,
    )


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> tuple[float, ...]:
    """Falcon's ALiBi as a slope per head on pagoda's scaled logits.

    transformers' Falcon adds ``alibi / sqrt(head_dim)`` to ``q.k / sqrt(head_dim)`` (its SDPA path, the
    default; see the tests for its eager path) with the slopes rounded to bfloat16 first
    (``build_alibi_tensor``: ``slopes.bfloat16() * positions``). Here the same bfloat16 slopes, times
    ``head_dim ** -0.5``. transformers also rounds each product ``slope * position`` to bfloat16; that
    is exact while slopes are powers of two (up to 8 heads) and positions below 256, and not
    reproduced beyond.
    """
    slopes = get_alibi_slopes(num_heads).to(torch.bfloat16).to(torch.float32) * head_dim**-0.5
    return tuple(float(s) for s in slopes.tolist())


def falcon_options(cfg: Any, dtype: torch.dtype = torch.float32) -> GPTOptions:
    """Falcon: rotary or ALiBi, parallel attention/MLP (one shared norm, or ln_attn / ln_mlp with
    ``new_decoder_architecture``), multi-query or grouped KV heads, biases by ``bias``."""
    heads = int(cfg.num_attention_heads)
    head_dim = int(cfg.hidden_size) // heads
    if head_dim * heads != cfg.hidden_size:
        raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={heads}")
    new_arch = bool(getattr(cfg, "new_decoder_architecture", False))
    parallel = bool(getattr(cfg, "parallel_attn", True))
    num_ln = getattr(cfg, "num_ln_in_parallel_attn", None)
    residual: Residual
    if new_arch:
        if not parallel:
            # transformers builds no ln_attn / ln_mlp then and its forward fails; nothing to match
            raise ValueError("Falcon with new_decoder_architecture=True and parallel_attn=False is not supported")
        residual = "parallel_shared_norm" if num_ln == 1 else "parallel_two_norms"
        kv_heads = int(cfg.num_kv_heads)
        layout: QKVLayout = "per_kv_group"
    else:
        if parallel and num_ln == 2:
            raise ValueError(
                "Falcon with num_ln_in_parallel_attn=2 needs new_decoder_architecture=True (transformers' forward "
                "reads ln_attn / ln_mlp only then)"
            )
        residual = "parallel_shared_norm" if parallel else "pre_norm"
        if getattr(cfg, "multi_query", True):
            kv_heads, layout = 1, "blocks"
        else:
            configured = getattr(cfg, "num_kv_heads", None)
            if configured not in (None, heads):
                # the classic layout fuses q, k and v per head: every head has its own k and v
                raise ValueError(
                    f"Falcon with multi_query=False and new_decoder_architecture=False has one KV head per "
                    f"head; num_kv_heads={configured} != num_attention_heads={heads} is not supported"
                )
            kv_heads, layout = heads, "per_head"
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
    alibi = bool(getattr(cfg, "alibi", False))
    bias = bool(getattr(cfg, "bias", False))
    return GPTOptions(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(getattr(cfg, "ffn_hidden_size", None) or 4 * cfg.hidden_size),
        hidden_act=cfg.activation,
        layer_norm_eps=float(cfg.layer_norm_epsilon),
        positions="alibi" if alibi else "rotary",
        residual=residual,
        final_norm=True,
        qkv_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bias,
        attention_scales=(head_dim**-0.5,) * int(cfg.num_hidden_layers),
        qkv_layout=layout,
        max_position_embeddings=int(cfg.max_position_embeddings),
        alibi_slopes=falcon_alibi_slopes(heads, head_dim) if alibi else None,
    )
