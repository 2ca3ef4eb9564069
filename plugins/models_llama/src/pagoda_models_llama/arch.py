"""How the Llama-family architectures differ, read off their Hugging Face configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEOptions:
    """Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): which layers are sparse, and their shape."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    renormalize: bool  # the top-k weights rescaled to sum to 1
    shared_expert_intermediate_size: int  # 0: no shared expert
    # One entry per layer: True where the layer's MLP is the MoE block, False for a dense MLP.
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True)
class DecoderOptions:
    """The per-architecture switches of an otherwise shared decoder."""

    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k heads, before RoPE
    # One entry per layer: the sliding window of that layer, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    moe: MoEOptions | None = None


def _layer_types_windows(hf_config: Any, window: int, num_layers: int) -> tuple[int | None, ...] | None:
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return None
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"config.layer_types holds unsupported layer types {sorted(unknown)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def qwen_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: ``layer_types`` (transformers >= 4.53) or ``use_sliding_window`` from ``max_window_layers`` on."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is None or not getattr(hf_config, "use_sliding_window", False):
        return (None,) * num_layers
    from_types = _layer_types_windows(hf_config, window, num_layers)
    if from_types is not None:
        return from_types
    first_sliding = getattr(hf_config, "max_window_layers", 0)
    return tuple(window if i >= first_sliding else None for i in range(num_layers))


def mistral_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Mistral applies ``sliding_window`` (when set) to every layer; transformers ignores layer_types for it."""
    return (getattr(hf_config, "sliding_window", None),) * hf_config.num_hidden_layers


def llama_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Llama has full attention, unless a derived config declares sliding layers via ``layer_types``."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is not None:
        from_types = _layer_types_windows(hf_config, window, num_layers)
        if from_types is not None:
            return from_types
    return (None,) * num_layers


def llama_options(hf_config: Any) -> DecoderOptions:
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderOptions(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=False,
        sliding_windows=llama_sliding_windows(hf_config),
    )


def mistral_options(hf_config: Any) -> DecoderOptions:
    return DecoderOptions(False, False, False, False, mistral_sliding_windows(hf_config))


def qwen2_options(hf_config: Any) -> DecoderOptions:
    return DecoderOptions(
        qkv_bias=True, o_proj_bias=False, mlp_bias=False, qk_norm=False, sliding_windows=qwen_sliding_windows(hf_config)
    )


def qwen3_options(hf_config: Any) -> DecoderOptions:
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderOptions(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=False,
        qk_norm=True,
        sliding_windows=qwen_sliding_windows(hf_config),
    )


def phi3_options(hf_config: Any) -> DecoderOptions:
    """Phi-3: no biases, ``sliding_window`` (when set) on every layer; qkv and gate/up come fused in the checkpoint."""
    return DecoderOptions(False, False, False, False, mistral_sliding_windows(hf_config))


def mixtral_options(hf_config: Any) -> DecoderOptions:
    """Mixtral: Mistral attention, every MLP a top-k MoE whose k weights are always renormalised."""
    num_layers = hf_config.num_hidden_layers
    moe = MoEOptions(
        num_experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.intermediate_size,
        renormalize=True,
        shared_expert_intermediate_size=0,
        sparse_layers=(True,) * num_layers,
    )
    return DecoderOptions(False, False, False, False, mistral_sliding_windows(hf_config), moe)


def _qwen_moe(hf_config: Any, shared_expert_intermediate_size: int) -> MoEOptions:
    """Qwen-MoE: a layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1)
    num_experts = hf_config.num_experts
    sparse = tuple(
        i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)
    )
    return MoEOptions(
        num_experts=num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        sparse_layers=sparse,
    )


def qwen2_moe_options(hf_config: Any) -> DecoderOptions:
    """Qwen2-MoE: Qwen2 attention (``qkv_bias``), routed experts plus a sigmoid-gated shared expert."""
    return DecoderOptions(
        qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_windows=qwen_sliding_windows(hf_config),
        moe=_qwen_moe(hf_config, int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)),
    )


def qwen3_moe_options(hf_config: Any) -> DecoderOptions:
    """Qwen3-MoE: Qwen3 attention (qk-norm); its config keeps ``sliding_window`` only when it applies, to every layer."""
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderOptions(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=False,
        qk_norm=True,
        sliding_windows=mistral_sliding_windows(hf_config),
        moe=_qwen_moe(hf_config, 0),
    )
