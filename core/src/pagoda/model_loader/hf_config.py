"""The model's ``transformers.PretrainedConfig``, from config.json or GGUF metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.model_loader.convert_cache import ConvertCache
from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.gguf_config import load_gguf_config
from pagoda.model_loader.source import ModelSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def load_hf_config(source: ModelSource, hf_overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """Read the config (offline: ``local_files_only``) and apply ``hf_overrides`` on top."""
    # transformers takes seconds to import: only pay for it when a config is read
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        if source.kind == "gguf":
            config = _load_gguf_config_cached(source)
        else:
            config = AutoConfig.from_pretrained(str(source.path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the model config of {source.display_name}: {exc}") from exc

    if source.kind == "gguf" and not config.architectures:
        # GGUF metadata names only the model type; the causal-LM class is what the engine serves.
        causal_lm_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal_lm_class is None:
            raise ModelLoadError(
                f"GGUF file {source.display_name} has model type {config.model_type!r}, which has no causal-LM architecture"
            )
        config.architectures = [causal_lm_class]

    if hf_overrides:
        apply_hf_overrides(config, hf_overrides)
    return config


def _load_gguf_config_cached(source: ModelSource) -> PretrainedConfig:
    """The GGUF file's config, from pagoda's convert cache when it holds it (the architectures are filled in after)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    cache = ConvertCache.for_gguf(source.gguf_path)
    cached = cache.read_config() if cache is not None else None
    if cached is not None and cached.get("model_type") in CONFIG_MAPPING:
        config = CONFIG_MAPPING[cached["model_type"]].from_dict(cached)
        config.name_or_path = str(source.path)
        return config
    config = load_gguf_config(source.gguf_path) or AutoConfig.from_pretrained(
        str(source.path), gguf_file=source.gguf_file, local_files_only=True
    )
    if cache is not None:
        cache.write_config(config.to_dict())
    return config


def apply_hf_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    """Set each override on ``config``; a dict aimed at a sub-config (e.g. ``text_config``) updates it key by key."""
    from transformers import PretrainedConfig

    if not isinstance(overrides, dict):
        raise ModelLoadError(f"hf_overrides must be a dict of config keys to values, got {type(overrides).__name__}")
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
