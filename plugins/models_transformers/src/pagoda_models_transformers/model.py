"""The transformers fallback: a transformers causal LM served by the engine (vLLM's ``model_impl="transformers"``).

``TransformersForCausalLM`` builds the transformers model from the config
(parameters on the meta device, then ``torch.empty``: ``load_weights`` fills
them), sets its attention implementation to ``"pagoda"`` (see ``attention.py``)
and adds one ``pagoda.attention.Attention`` per decoder layer, which the model
runner binds to the paged KV cache like any family's. A step's flat batch
(``[T]`` tokens of many sequences) goes in as one sequence of ``T`` tokens with
the absolute ``position_ids``; since attention is the only place tokens meet
(``support.py`` refuses models where it is not), the paged layers keep the
sequences apart. transformers' ``nn.Linear`` layers are swapped for pagoda's
``Linear`` so the platform's packed matmul serves them.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata
from pagoda.distributed import get_tensor_model_parallel_world_size
from pagoda_models_transformers.attention import (
    ATTN_IMPLEMENTATION,
    CONTEXT_KWARG,
    PagodaAttentionContext,
    register_attention_function,
)
from pagoda_models_transformers.construction import (
    materialize_parameters,
    parameters_on_meta,
    replace_linear_layers,
)
from pagoda_models_transformers.support import FallbackUnsupportedError, reasons_unsupported, resolve_class

logger = logging.getLogger(__name__)

# Checkpoint tensors that are buffers transformers recomputes (older checkpoints carry them).
_RECOMPUTED_BUFFERS = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias|\.masked_bias)$")


def _transformers_config(hf_config: Any) -> Any:
    """A private ``PretrainedConfig`` copy (the engine's is shared; the attention implementation is set on ours)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        return copy.deepcopy(hf_config)
    # pagoda's CachedHFConfig (a GGUF file's cached config): rebuild transformers' config class from its values
    values = dict(hf_config.to_dict())
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def _layer_windows(cfg: Any, modules: dict[int, nn.Module], num_layers: int) -> list[int | None]:
    """Each layer's sliding window: the attention module's own, else from the config's layer types."""
    windows: list[int | None] = []
    layer_types = getattr(cfg, "layer_types", None)
    for i in range(num_layers):
        module = modules.get(i)
        if module is not None and hasattr(module, "sliding_window"):
            window: Any = module.sliding_window
            windows.append(int(window) if window else None)
        elif layer_types:
            windows.append(cfg.sliding_window if layer_types[i] == "sliding_attention" else None)
        elif getattr(cfg, "use_sliding_window", True) is not False:
            # Mistral-style configs: one window for every layer, no layer types
            windows.append(getattr(cfg, "sliding_window", None) or None)
        else:
            windows.append(None)
    return windows


def build_attention_layers(cfg: Any, hf_model: nn.Module, architecture: str) -> nn.ModuleList:
    """One paged ``Attention`` per decoder layer, shaped like transformers' attention module of that layer.

    Head counts and sizes come from the module where it keeps them (``head_dim``, ``num_key_value_groups``,
    ``scaling``), else from the config; each call checks the q/k/v it actually gets against them.
    """
    modules: dict[int, nn.Module] = {
        int(getattr(m, "layer_idx")): m  # noqa: B009  # typed as a module attribute, an int here
        for m in hf_model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
    }
    num_layers = int(cfg.num_hidden_layers)
    num_heads = int(cfg.num_attention_heads)
    windows = _layer_windows(cfg, modules, num_layers)
    soft_cap = getattr(cfg, "attn_logit_softcapping", None)
    layers: list[Attention] = []
    for i in range(num_layers):
        module = modules.get(i)
        head_dim = int(
            getattr(module, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        )
        groups = getattr(module, "num_key_value_groups", None)
        if groups:
            num_kv_heads = num_heads // int(groups)
        else:
            num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        scale = getattr(module, "scaling", None)
        layers.append(
            Attention(
                num_heads=num_heads,
                head_dim=head_dim,
                scale=float(scale) if scale is not None else head_dim**-0.5,
                num_kv_heads=num_kv_heads,
                sliding_window=windows[i],
                logits_soft_cap=getattr(module, "attn_logit_softcapping", soft_cap) or None,
                layer_idx=i,
            )
        )
    shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
    if len(shapes) > 1:
        # the engine keeps one KV-cache layout for all layers
        raise FallbackUnsupportedError(
            f"{architecture} has layers with different KV shapes (kv heads, head_dim) {sorted(shapes)}; "
            "the paged KV cache holds one layout for all layers"
        )
    return nn.ModuleList(layers)


class TransformersForCausalLM(nn.Module):
    """The engine-facing model (``pagoda.models.interface.CausalLMModel``) around a transformers causal LM."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, trust_remote_code: bool = False) -> None:
        super().__init__()
        cfg = _transformers_config(hf_config)
        reasons = reasons_unsupported(cfg, trust_remote_code)
        if reasons:
            raise FallbackUnsupportedError(f"the transformers fallback cannot serve this model: {'; '.join(reasons)}")
        cls: Any = resolve_class(cfg, trust_remote_code)
        self.architecture: str = cls.__name__
        if get_tensor_model_parallel_world_size() > 1:
            # transformers' own modules hold whole layers: nothing here splits them across ranks
            raise FallbackUnsupportedError(
                f"the transformers fallback cannot serve {self.architecture} with tensor parallelism: its layers are "
                "transformers' own, not core's parallel layers; run it with tensor_parallel_size=1, or with a model "
                "family plugin that serves this architecture")
        register_attention_function()
        from transformers.initialization import no_init_weights

        device = torch.get_default_device()
        with parameters_on_meta(), no_init_weights():
            hf_model = cls._from_config(cfg, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        hf_model.eval()
        hf_model.tie_weights()  # the input and output embeddings one parameter where the config ties them
        self.num_linear_replaced = replace_linear_layers(hf_model)
        materialize_parameters(hf_model, dtype, device)
        self.model = hf_model
        self.config = hf_model.config
        self.dtype = dtype
        if hf_model.get_output_embeddings() is None:
            raise FallbackUnsupportedError(f"{self.architecture} has no output embeddings (LM head)")
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.attn_layers = build_attention_layers(text_cfg, hf_model, self.architecture)
        # a plain tuple for the per-call lookup by layer_idx
        self._layers: tuple[Attention, ...] = tuple(self.attn_layers)  # type: ignore[arg-type]
        # The causal-LM heads' own logit transforms (transformers applies them after the LM head).
        self.final_logit_softcapping: float | None = getattr(text_cfg, "final_logit_softcapping", None)
        self.logit_scale: float | None = getattr(text_cfg, "logit_scale", None)
        self.logits_scaling: float | None = getattr(text_cfg, "logits_scaling", None)

    @property
    def decoder(self) -> nn.Module:
        """The transformers model without its LM head: logits are computed at sampling rows only."""
        base: nn.Module = self.model.base_model
        return base

    @property
    def lm_head(self) -> nn.Module:
        head: nn.Module = self.model.get_output_embeddings()
        return head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        context = PagodaAttentionContext(self._layers, metadata, self.architecture)
        out = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            **{CONTEXT_KWARG: context},
        )
        hidden: torch.Tensor = out[0] if isinstance(out, tuple) else out.last_hidden_state
        return hidden[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_transformers_weights(self.model, weights)


def load_transformers_weights(hf_model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors into the transformers model's parameters (names as in its ``state_dict``).

    A checkpoint saved from the base model alone (without ``base_model_prefix``) loads too. Unknown
    names, shape mismatches and parameters left unfilled raise ``ValueError`` naming the weight; a
    tied parameter counts as filled by either of its names.
    """
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    state_names = set(hf_model.state_dict())
    persistent = {name: buf for name, buf in hf_model.named_buffers() if name in state_names}
    prefix = str(getattr(hf_model, "base_model_prefix", "") or "")
    ignored = [re.compile(p) for p in (getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    filled: set[int] = set()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            key = name
            if key not in params and key not in persistent and prefix and f"{prefix}.{key}" in params:
                key = f"{prefix}.{key}"
            target: torch.Tensor | None = params.get(key)
            if target is None:
                target = persistent.get(key)
            if target is None:
                if _RECOMPUTED_BUFFERS.search(name) or any(p.search(name) for p in ignored):
                    continue
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(hf_model).__name__}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.data.copy_(tensor)
            filled.add(id(target))
            loaded.add(name)
    missing = [name for name, param in params.items() if id(param) not in filled]
    if missing:
        # parameters start uninitialised (torch.empty): a gap would be garbage, not an error later
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded
