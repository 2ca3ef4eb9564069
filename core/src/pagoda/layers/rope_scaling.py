"""RoPE parameters read from a Hugging Face config, and the inverse frequencies of each scaling type.

The math follows transformers' rope-init functions (``modeling_rope_utils``) so
that a checkpoint sees the same angles it was trained with. Frequencies are
computed in float32 exactly as transformers does, because the angle at large
positions is sensitive to the rounding of ``inv_freq``.

Sequence-length-dependent scalings need an engine choice, since one batch mixes
sequences of many lengths:

* ``dynamic`` (dynamic NTK): transformers rescales the base whenever the
  current sequence outgrows ``max_position_embeddings``. Here the base is
  scaled once, for the longest context the scaling allows
  (``max_position_embeddings * factor``), and used for every position. This is
  transformers' formula evaluated at ``seq_len = max_position_embeddings *
  factor`` (the same choice vLLM makes); short sequences therefore see
  slightly different angles than under transformers' per-call rescaling.
* ``longrope`` (Phi-3; ``su`` in older configs): transformers rotates a whole
  forward with the ``long_factor`` frequencies once the longest position in it
  reaches ``original_max_position_embeddings``, else with ``short_factor``.
  Here the choice is per position: positions below
  ``original_max_position_embeddings`` use the short factors, the rest the long
  ones. A token's key then depends only on its token and position, which the
  paged KV cache and prefix caching need, and decode steps match transformers
  exactly; a prompt that crosses the threshold sees short-factor angles at its
  early positions where transformers would use long ones. (vLLM switches the
  whole batch to long factors when any token passes the threshold, so one long
  request changes the others' angles.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Older names transformers still reads: Phi-3's first configs said "su" for longrope.
_ROPE_TYPE_ALIASES = {"su": "longrope"}
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Everything the rotary embedding needs, normalised from any config layout."""

    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int
    max_position_embeddings: int
    # The remaining scaling keys (factor, original_max_position_embeddings, ...).
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def factor(self) -> float:
        factor = self.scaling.get("factor")
        if factor is None:
            raise ValueError(f"rope scaling {self.rope_type!r} needs a 'factor' in the config's rope parameters")
        return float(factor)

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.scaling.get("original_max_position_embeddings") or self.max_position_embeddings)

    @property
    def max_positions(self) -> int:
        """Positions the cos/sin cache covers: the longest context this scaling serves."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            factor = self.scaling.get("factor")
            scaled = int(self.original_max_position_embeddings * factor) if factor else 0
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings


def _raw_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers >= 5 keeps RoPE settings in ``rope_parameters``; older releases in ``rope_scaling`` + ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a dict, got {type(params).__name__}: {params!r}")
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    if nested:
        raise ValueError(f"per-layer-type rope parameters ({nested}) are not supported by the Llama family")
    return dict(params)


def rope_config_from_hf(hf_config: Any) -> RopeConfig:
    params = _raw_rope_parameters(hf_config)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or DEFAULT_ROPE_THETA
    partial = params.pop("partial_rotary_factor", None) or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise ValueError(f"rotary dimension must be even, got head_dim={head_dim} * partial_rotary_factor={partial}")
    # A top-level original_max_position_embeddings wins over the rope dict (Phi-3 style), as in transformers.
    top_level_original = getattr(hf_config, "original_max_position_embeddings", None)
    if top_level_original is not None and rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = top_level_original
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        scaling=params,
    )


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _linear(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(cfg.theta, cfg.rotary_dim) / cfg.factor, 1.0


def _dynamic_ntk(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    # Evaluated at the longest context (see the module docstring).
    factor, dim, max_pos = cfg.factor, cfg.rotary_dim, cfg.max_position_embeddings
    seq_len = cfg.max_positions
    base = cfg.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(cfg.theta, cfg.rotary_dim)
    factor = cfg.factor
    low_freq_factor = float(cfg.scaling["low_freq_factor"])
    high_freq_factor = float(cfg.scaling["high_freq_factor"])
    old_context_len = cfg.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept; the band between is blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    p = cfg.scaling
    dim, base = cfg.rotary_dim, cfg.theta
    original_max = cfg.original_max_position_embeddings
    factor = p.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / original_max
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1
    truncate = p.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    return inv_freq, float(attention_factor)


def _longrope_factor_and_attention(cfg: RopeConfig) -> tuple[float, float]:
    original_max = cfg.original_max_position_embeddings
    factor = cfg.scaling.get("factor")
    if factor is None:
        # Phi-3 raises max_position_embeddings and keeps the pretrained length beside it
        factor = cfg.max_position_embeddings / original_max
    attention_factor = cfg.scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    return float(factor), float(attention_factor)


def longrope_inv_freqs(cfg: RopeConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE: (short-factor inv_freq, long-factor inv_freq, attention factor), as transformers computes them."""
    half = cfg.rotary_dim // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = cfg.scaling.get(key)
        if values is None or len(values) != half:
            got = "none" if values is None else f"{len(values)} values"
            raise ValueError(f"longrope needs rope parameter {key!r} with rotary_dim / 2 = {half} values, got {got}")
        factors[key] = torch.tensor(values, dtype=torch.float32)
    _, attention_factor = _longrope_factor_and_attention(cfg)
    shape = torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64).float() / cfg.rotary_dim
    short = 1.0 / (factors["short_factor"] * cfg.theta**shape)
    long = 1.0 / (factors["long_factor"] * cfg.theta**shape)
    return short, long, attention_factor


def _longrope(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    short, _, attention_factor = longrope_inv_freqs(cfg)
    return short, attention_factor


def _default(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(cfg.theta, cfg.rotary_dim), 1.0


_INV_FREQ_FNS = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic_ntk,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def inv_freq_and_attention_factor(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [rotary_dim // 2] (on the CPU) and the factor cos/sin are multiplied by.

    For ``longrope`` these are the short-factor frequencies (positions below the
    original context); ``rope_angles`` gives every position its own.
    """
    return _INV_FREQ_FNS[cfg.rope_type](cfg)


def rope_angles(cfg: RopeConfig, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float32 angles [len(positions), rotary_dim // 2] for float32 ``positions``, and the cos/sin factor."""
    if cfg.rope_type == "longrope":
        short, long, attention_factor = longrope_inv_freqs(cfg)
        is_long = (positions >= cfg.original_max_position_embeddings)[:, None]
        inv_freq = torch.where(is_long, long.to(positions.device)[None, :], short.to(positions.device)[None, :])
        return positions[:, None] * inv_freq, attention_factor
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg)
    return positions[:, None] * inv_freq.to(positions.device)[None, :], attention_factor
