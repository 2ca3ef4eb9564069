"""The attention function registered with transformers: each attention module's q/k/v into pagoda's paged attention.

transformers' attention modules project q/k/v (and rotate them) themselves,
then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. With the
implementation set to ``"pagoda"`` that call lands here: the module's
``layer_idx`` picks its ``pagoda.attention.Attention`` layer (bound to the
engine's KV cache by the model runner), which writes the new K/V into the
paged cache and attends over everything cached for each sequence. The step's
layers and ``AttentionMetadata`` arrive as a keyword argument of the model's
forward, which transformers hands down to every attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata

ATTN_IMPLEMENTATION = "pagoda"
# The keyword the wrapper passes to the transformers model's forward.
CONTEXT_KWARG = "pagoda_attention"

# Keywords transformers passes along to attention functions that do not change its math here
# (no KV cache of transformers' own, no padding, eval mode).
_IGNORED_KWARGS = frozenset(
    {
        CONTEXT_KWARG,
        "position_ids",
        "cache_position",
        "past_key_values",
        "layer_past",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "position_embeddings",
        "is_causal",
        "token_type_ids",
    }
)


@dataclass
class PagodaAttentionContext:
    """One step's attention layers (indexed by transformers' ``layer_idx``) and batch layout."""

    layers: Sequence[Attention]
    metadata: AttentionMetadata
    architecture: str


def _unsupported(ctx: PagodaAttentionContext, module: nn.Module, what: str) -> RuntimeError:
    return RuntimeError(
        f"the transformers fallback cannot serve {ctx.architecture}: {type(module).__name__} "
        f"(layer {getattr(module, 'layer_idx', '?')}) {what}"
    )


def _check_call(
    ctx: PagodaAttentionContext,
    module: nn.Module,
    layer: Attention,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    if attention_mask is not None:
        raise _unsupported(ctx, module, "passes its own attention mask; only plain causal attention is routed")
    if dropout:
        raise _unsupported(ctx, module, f"asks for attention dropout {dropout} (the model is not in eval mode)")
    if getattr(module, "is_causal", True) is False:
        raise _unsupported(ctx, module, "is not causal attention")
    window = kwargs.get("sliding_window")
    if window is not None and window != layer.sliding_window:
        raise _unsupported(
            ctx, module, f"asks for sliding window {window}, its paged layer was built with {layer.sliding_window}"
        )
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap != layer.logits_soft_cap:
        raise _unsupported(
            ctx, module, f"asks for soft-cap {softcap}, its paged layer was built with {layer.logits_soft_cap}"
        )
    unknown = sorted(
        k for k, v in kwargs.items()
        if k not in _IGNORED_KWARGS and k not in ("sliding_window", "softcap") and v is not None and v is not False
    )
    if unknown:
        raise _unsupported(ctx, module, f"passes attention arguments the paged backends do not take: {', '.join(unknown)}")


def pagoda_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([1, T, num_heads, head_dim], no weights)."""
    ctx: PagodaAttentionContext | None = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__} called pagoda's attention without the step's context: its model does not "
            "hand the forward's keyword arguments down to attention, so the transformers fallback cannot serve it"
        )
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(ctx.layers):
        raise _unsupported(ctx, module, f"has layer_idx {layer_idx!r}, not one of the {len(ctx.layers)} decoder layers")
    layer = ctx.layers[layer_idx]
    _check_call(ctx, module, layer, attention_mask, dropout, kwargs)
    batch, num_heads, t, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if (batch, num_heads, num_kv_heads, head_dim) != (1, layer.num_heads, layer.num_kv_heads, layer.head_dim):
        raise _unsupported(
            ctx, module,
            f"gives q/k/v of {num_heads}/{num_kv_heads} heads of {head_dim} (batch {batch}); its paged layer "
            f"expects {layer.num_heads}/{layer.num_kv_heads} heads of {layer.head_dim} (batch 1)",
        )
    if scaling is not None:
        # The module's own scale is the truth (it may differ from head_dim**-0.5); a float store per call.
        layer.scale = float(scaling)
    q = query[0].transpose(0, 1).reshape(t, num_heads * head_dim)
    k = key[0].transpose(0, 1).reshape(t, num_kv_heads * head_dim)
    v = value[0].transpose(0, 1).reshape(t, num_kv_heads * head_dim)
    out = layer(q, k, v, ctx.metadata)
    return out.view(1, t, num_heads, head_dim), None


def register_attention_function() -> None:
    """Make ``attn_implementation="pagoda"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagoda_attention_forward)
