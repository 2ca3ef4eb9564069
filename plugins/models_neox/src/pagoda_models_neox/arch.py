"""How GPT-NeoX, Phi and StableLM differ, read off their Hugging Face configs.

All three are LayerNorm decoders with partial rotary embeddings; they differ in
how attention and MLP share the residual stream, in their biases, their MLP and
their optional norm on q and k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# sequential:           h = h + attn(ln1(h)); h = h + mlp(ln2(h))
# parallel:             h = h + attn(ln1(h)) + mlp(ln2(h))    (GPT-NeoX use_parallel_residual)
# parallel_shared_norm: n = ln1(h); h = h + attn(n) + mlp(n)  (Phi; StableLM use_parallel_residual)
Residual = Literal["sequential", "parallel", "parallel_shared_norm"]
# plain: fc2(act(fc1(x))); gated: down(act(gate(x)) * up(x)) with gate/up fused (SwiGLU)
MLPKind = Literal["plain", "gated"]
# shared: one LayerNorm over head_dim for every head (Phi); per_head: each head its own (StableLM)
QKNorm = Literal["none", "shared", "per_head"]


@dataclass(frozen=True)
class NeoXOptions:
    """The per-architecture switches of the shared decoder."""

    residual: Residual
    qkv_bias: bool
    o_proj_bias: bool
    mlp: MLPKind
    mlp_bias: bool
    hidden_act: str
    qk_norm: QKNorm
    qk_norm_bias: bool
    lm_head_bias: bool
    head_dim: int
    num_kv_heads: int


def _head_dim(cfg: Any) -> int:
    return int(cfg.hidden_size // cfg.num_attention_heads)


def _num_kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def gpt_neox_options(cfg: Any) -> NeoXOptions:
    """GPT-NeoX (Pythia): biases everywhere (``attention_bias``), two norms, parallel residual by default."""
    bias = bool(getattr(cfg, "attention_bias", True))
    return NeoXOptions(
        residual="parallel" if getattr(cfg, "use_parallel_residual", True) else "sequential",
        qkv_bias=bias,
        o_proj_bias=bias,
        mlp="plain",
        mlp_bias=True,
        hidden_act=cfg.hidden_act,
        qk_norm="none",
        qk_norm_bias=False,
        lm_head_bias=False,
        head_dim=_head_dim(cfg),
        num_kv_heads=cfg.num_attention_heads,
    )


def phi_options(cfg: Any) -> NeoXOptions:
    """Phi-1/1.5/2: one input norm feeding attention and MLP, biases everywhere including the LM head."""
    head_dim = getattr(cfg, "head_dim", None) or _head_dim(cfg)
    if head_dim != _head_dim(cfg):
        # transformers sizes Phi's q/k LayerNorm by hidden_size // heads while projecting to head_dim
        raise ValueError(f"Phi with head_dim={head_dim} != hidden_size // num_attention_heads is not supported")
    return NeoXOptions(
        residual="parallel_shared_norm",
        qkv_bias=True,
        o_proj_bias=True,
        mlp="plain",
        mlp_bias=True,
        hidden_act=cfg.hidden_act,
        qk_norm="shared" if getattr(cfg, "qk_layernorm", False) else "none",
        qk_norm_bias=True,
        lm_head_bias=True,
        head_dim=head_dim,
        num_kv_heads=_num_kv_heads(cfg),
    )


def stablelm_options(cfg: Any) -> NeoXOptions:
    """StableLM (3B-4E1T, 2): SwiGLU MLP, optional qkv bias, per-head q/k norms and parallel residual."""
    parallel = bool(getattr(cfg, "use_parallel_residual", False))
    return NeoXOptions(
        residual="parallel_shared_norm" if parallel else "sequential",
        qkv_bias=bool(getattr(cfg, "use_qkv_bias", False)),
        o_proj_bias=False,
        mlp="gated",
        mlp_bias=False,
        hidden_act=cfg.hidden_act,
        qk_norm="per_head" if getattr(cfg, "qk_layernorm", False) else "none",
        qk_norm_bias=False,
        lm_head_bias=False,
        head_dim=_head_dim(cfg),
        num_kv_heads=_num_kv_heads(cfg),
    )
