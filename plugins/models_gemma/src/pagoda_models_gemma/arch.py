"""How the Gemma generations differ, read off their Hugging Face configs.

* Gemma: a Llama-shaped decoder with (1 + weight) RMSNorms, a scaled embedding, GeGLU.
* Gemma 2: adds a norm after attention and around the MLP ("sandwich" norms),
  attention and final logit soft-capping, alternating sliding-window layers
  (``layer_types``) and ``query_pre_attn_scalar`` as the attention scale.
* Gemma 3 (text): Gemma 2 plus RMSNorm over each q and k head and a RoPE base
  per layer type (local / global); its attention never soft-caps (transformers'
  Gemma 3 reads ``attn_logit_softcapping`` but does not apply it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagoda.layers import RopeConfig, rope_config_from_hf

logger = logging.getLogger(__name__)

_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GemmaOptions:
    """The per-generation switches of the shared Gemma decoder."""

    hidden_activation: str
    attention_bias: bool
    attention_scale: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sandwich_norms: bool  # Gemma 2/3: post-attention and pre/post-feedforward norms
    qk_norm: bool  # Gemma 3: (1 + weight) RMSNorm over head_dim on q and k heads, before RoPE
    # One entry per layer: the sliding window of that layer, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    # RoPE tables by name, and the name each layer rotates with (Gemma 3: one per layer type).
    ropes: dict[str, RopeConfig]
    layer_ropes: tuple[str, ...]


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _layer_types(cfg: Any) -> tuple[str, ...]:
    layer_types = tuple(getattr(cfg, "layer_types", None) or ("full_attention",) * cfg.num_hidden_layers)
    if len(layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {cfg.num_hidden_layers} layers")
    unknown = set(layer_types) - set(_LAYER_TYPES)
    if unknown:
        raise ValueError(f"config.layer_types holds unsupported layer types {sorted(unknown)}")
    return layer_types


def _sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    # As in transformers: a sliding layer with no ``sliding_window`` attends to everything.
    window = getattr(cfg, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" else None for kind in _layer_types(cfg))


def _positive_or_none(cfg: Any, name: str) -> float | None:
    value = getattr(cfg, name, None)
    if value is None:
        return None
    if value <= 0:
        raise ValueError(f"config.{name}={value} must be positive (or null to switch it off)")
    return float(value)


def _check_causal(cfg: Any) -> None:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (an encoder-style Gemma) is not supported: pagoda serves causal decoders"
        )


def gemma_options(cfg: Any) -> GemmaOptions:
    _check_causal(cfg)
    num_layers = cfg.num_hidden_layers
    return GemmaOptions(
        # transformers' GemmaMLP reads hidden_act (its config maps the legacy exact "gelu" to the tanh form)
        hidden_activation=cfg.hidden_act,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        attention_scale=head_dim(cfg) ** -0.5,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sandwich_norms=False,
        qk_norm=False,
        sliding_windows=(None,) * num_layers,
        ropes={"default": rope_config_from_hf(cfg)},
        layer_ropes=("default",) * num_layers,
    )


def gemma2_options(cfg: Any) -> GemmaOptions:
    _check_causal(cfg)
    num_layers = cfg.num_hidden_layers
    return GemmaOptions(
        hidden_activation=cfg.hidden_activation,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        attn_logit_softcapping=_positive_or_none(cfg, "attn_logit_softcapping"),
        final_logit_softcapping=_positive_or_none(cfg, "final_logit_softcapping"),
        sandwich_norms=True,
        qk_norm=False,
        sliding_windows=_sliding_windows(cfg),
        ropes={"default": rope_config_from_hf(cfg)},
        layer_ropes=("default",) * num_layers,
    )


class _RopeView:
    """The config as ``rope_config_from_hf`` sees it, with one layer type's rope parameters at the top level."""

    def __init__(self, cfg: Any, rope_parameters: dict[str, Any]) -> None:
        self._cfg = cfg
        self.rope_parameters = rope_parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def gemma3_options(cfg: Any) -> GemmaOptions:
    _check_causal(cfg)
    layer_types = _layer_types(cfg)
    params = getattr(cfg, "rope_parameters", None) or {}
    missing = [kind for kind in sorted(set(layer_types)) if not isinstance(params.get(kind), dict)]
    if missing:
        raise ValueError(f"config.rope_parameters has no entry for layer type(s) {missing}")
    attn_cap = _positive_or_none(cfg, "attn_logit_softcapping")
    if attn_cap is not None:
        # Following the reference keeps the checkpoint's outputs; the log says so instead of a silent drop.
        logger.warning(
            "Gemma3: attn_logit_softcapping=%s is not applied (transformers' Gemma3 attention does not apply it)",
            attn_cap,
        )
    return GemmaOptions(
        hidden_activation=cfg.hidden_activation,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        attn_logit_softcapping=None,
        final_logit_softcapping=_positive_or_none(cfg, "final_logit_softcapping"),
        sandwich_norms=True,
        qk_norm=True,
        sliding_windows=_sliding_windows(cfg),
        ropes={kind: rope_config_from_hf(_RopeView(cfg, dict(params[kind]))) for kind in sorted(set(layer_types))},
        layer_ropes=layer_types,
    )
