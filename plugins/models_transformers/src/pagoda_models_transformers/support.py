"""Which transformers class serves a config through the fallback, and why one cannot.

The fallback routes every attention module's q/k/v into pagoda's paged
attention through transformers' attention interface, and feeds the engine's
flat token batch as one sequence with explicit ``position_ids``. That is exact
only for decoder-only causal LMs whose tokens meet nowhere but in attention,
and whose transformers class calls the attention interface
(``_supports_attention_backend``); everything else is refused here, with the
reason, before anything is built.
"""

from __future__ import annotations

from typing import Any

# transformers' layer types that are plain (possibly windowed) softmax attention.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Sub-configs of multimodal models: their towers and projectors never run here.
_MODALITY_CONFIGS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")


class FallbackUnsupportedError(ValueError):
    """The transformers fallback cannot serve this config; the message says why."""


def _remote_reference(hf_config: Any, arch: str) -> str | None:
    """The ``auto_map`` entry (``module.Class``) for ``arch`` as an AutoModelForCausalLM, if the config has one."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    ref = auto_map.get("AutoModelForCausalLM")
    if isinstance(ref, (list, tuple)):
        ref = ref[0]
    if isinstance(ref, str) and ref.rsplit(".", 1)[-1] == arch:
        return ref
    return None


def resolve_class(hf_config: Any, trust_remote_code: bool) -> type:
    """The transformers causal-LM class for the config's first architecture; raises ``FallbackUnsupportedError``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise FallbackUnsupportedError("the config names no architectures")
    arch = archs[0]
    remote = _remote_reference(hf_config, arch)
    causal_lm_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # As transformers' AutoModelForCausalLM decides: the directory's own code when trusted, else the library's
    # class of that name, else a refusal that names trust_remote_code.
    if remote is not None and not trust_remote_code and arch not in causal_lm_names:
        raise FallbackUnsupportedError(
            f"{arch} is the model directory's own code (auto_map {remote!r}); "
            "pass trust_remote_code=True to let transformers import and run it"
        )
    if remote is not None and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        name_or_path = str(getattr(hf_config, "name_or_path", "") or getattr(hf_config, "_name_or_path", ""))
        if not name_or_path:
            raise FallbackUnsupportedError(f"{arch} is remote code, but the config does not say where it was read from")
        cls: type = get_class_from_dynamic_module(remote, name_or_path, local_files_only=True)
        return cls
    if arch not in causal_lm_names:
        if hasattr(transformers, arch):
            raise FallbackUnsupportedError(
                f"{arch} is not a causal language model in transformers {transformers.__version__} "
                "(AutoModelForCausalLM does not list it); the fallback serves decoder-only causal LMs only"
            )
        raise FallbackUnsupportedError(
            f"transformers {transformers.__version__} implements no architecture named {arch}"
            + ("" if remote is None else f" (the config's auto_map names {remote!r})")
        )
    found: type = getattr(transformers, arch)
    return found


def _config_reasons(hf_config: Any) -> list[str]:
    reasons: list[str] = []
    if getattr(hf_config, "is_encoder_decoder", False):
        reasons.append("it is an encoder-decoder model; the fallback serves decoder-only causal LMs only")
    modalities = [name for name in _MODALITY_CONFIGS if getattr(hf_config, name, None) is not None]
    if modalities:
        reasons.append(f"it is a multimodal model ({', '.join(modalities)}); the fallback serves text-only decoders")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
        if other:
            # recurrent / convolution / linear-attention layers mix tokens outside attention: on the
            # engine's flat batch they would mix different requests' tokens.
            reasons.append(f"its layers include {', '.join(other)}, not only softmax attention")
    return reasons


def reasons_unsupported(hf_config: Any, trust_remote_code: bool = False) -> list[str]:
    """Why the fallback cannot serve ``hf_config`` (empty: it can).

    ``hf_config`` may hold only ``architectures`` (``pagoda plugins list`` asking by name); the
    checks that need more of the config then pass.
    """
    reasons = _config_reasons(hf_config)
    try:
        cls = resolve_class(hf_config, trust_remote_code)
    except FallbackUnsupportedError as exc:
        return [*reasons, str(exc)]
    except (ImportError, OSError) as exc:  # remote code that cannot be imported
        return [*reasons, f"its model code cannot be imported: {type(exc).__name__}: {exc}"]
    if not getattr(cls, "_supports_attention_backend", False):
        reasons.append(
            f"transformers' {cls.__name__} does not support the attention interface (_supports_attention_backend "
            "is False: it computes attention itself, e.g. with an ALiBi bias or its own kernels), so its attention "
            "cannot be routed into pagoda's paged KV cache"
        )
    return reasons
