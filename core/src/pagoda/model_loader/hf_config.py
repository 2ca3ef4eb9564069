"""The model's ``transformers.PretrainedConfig``, from config.json or GGUF metadata."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagoda.model_loader.convert_cache import ConvertCache
from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.gguf.config import load_gguf_config
from pagoda.model_loader.source import ModelSource, resolve_model_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def load_hf_config(
    source: ModelSource, hf_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False
) -> PretrainedConfig:
    """Read the config (offline: ``local_files_only``) and apply ``hf_overrides`` on top.

    ``trust_remote_code`` lets transformers import the directory's own config class (``auto_map``).
    """
    config: PretrainedConfig = _load_config(source, hf_overrides, light=False, trust_remote_code=trust_remote_code)
    return config


def load_model_config(
    source: ModelSource, hf_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False
) -> Any:
    """What the engine builds its model from: ``load_hf_config``'s values, or a ``CachedHFConfig`` of them.

    The engine's start-up path: a GGUF file's cached config comes back without
    importing transformers' config classes. Not for handing to transformers' own
    model classes, which insist on a ``PretrainedConfig`` (use ``load_hf_config``).
    """
    return _load_config(source, hf_overrides, light=True, trust_remote_code=trust_remote_code)


def _config_validation_errors() -> tuple[type[BaseException], ...]:
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub checks no types
        return ()
    return (StrictDataclassError,)


def _load_config(
    source: ModelSource, hf_overrides: dict[str, Any] | None, light: bool, trust_remote_code: bool = False
) -> Any:
    # transformers takes seconds to import: only pay for it when a config is read
    try:
        if source.kind == "gguf":
            config = _load_gguf_config_cached(source, light)
        else:
            config = _load_hf_dir_config(source, trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, *_config_validation_errors()) as exc:
        # a type-invalid config.json (huggingface_hub's strict dataclass check): one line, not a traceback
        raise ModelLoadError(f"Cannot read the model config of {source.display_name}: {exc}") from exc

    if hf_overrides:
        apply_hf_overrides(config, hf_overrides)
    return config


def _load_hf_dir_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """config.json through AutoConfig; a model_type transformers does not know is read as a plain config.

    An out-of-tree model family (docs/adding_a_model.md) brings its own
    architecture and model_type; its model reads config.json's fields as
    attributes, which a plain ``PretrainedConfig`` holds without a config class.
    """
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return AutoConfig.from_pretrained(
            str(source.path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except ValueError:
        config_dict, _ = PretrainedConfig.get_config_dict(str(source.path), local_files_only=True)
        model_type = config_dict.get("model_type")
        if not model_type or model_type in CONFIG_MAPPING or "auto_map" in config_dict:
            raise  # not an unknown model type: transformers' own message says what is wrong
        logger.info("model_type %r is unknown to transformers: config.json read as a plain PretrainedConfig", model_type)
        config = PretrainedConfig.from_dict(config_dict)
        config.name_or_path = str(source.path)
        return config


def gguf_config_is_plain_values(model: str | None) -> bool:
    """Whether ``load_model_config`` will answer a ``CachedHFConfig`` (no transformers object) for the GGUF
    file ``model`` (None: the embedded default): pagoda's convert cache holds its config. False for
    anything else, or when it cannot tell (the first start of a file: transformers reads it)."""
    try:
        source = resolve_model_path(model)
    except (OSError, ValueError):  # (ModelLoadError is a ValueError) the load reports it
        return False
    if source.kind != "gguf":
        return False
    cache = ConvertCache.for_gguf(source.gguf_path)
    cached = cache.read_config() if cache is not None else None
    return cached is not None and CachedHFConfig.can_hold(cached)


def _load_gguf_config_cached(source: ModelSource, light: bool) -> Any:
    """The GGUF file's config, from pagoda's convert cache when it holds it.

    With ``light``, a cached entry written with its architectures comes back as a ``CachedHFConfig``
    without importing transformers' config classes (~1.5 s of imports on the
    reference CPU, a third of the server's start-up).
    """
    cache = ConvertCache.for_gguf(source.gguf_path)
    cached = cache.read_config() if cache is not None else None
    if light and cached is not None and CachedHFConfig.can_hold(cached):
        config: Any = CachedHFConfig(cached)
        config.name_or_path = str(source.path)
        return config
    from transformers import CONFIG_MAPPING, AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cached is not None and cached.get("model_type") in CONFIG_MAPPING:
        config = CONFIG_MAPPING[cached["model_type"]].from_dict(cached)
    else:
        config = load_gguf_config(source.gguf_path) or AutoConfig.from_pretrained(
            str(source.path), gguf_file=source.gguf_file, local_files_only=True
        )
    config.name_or_path = str(source.path)
    if not config.architectures:
        # GGUF metadata names only the model type; the causal-LM class is what the engine serves.
        causal_lm_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal_lm_class is None:
            raise ModelLoadError(
                f"GGUF file {source.display_name} has model type {config.model_type!r}, which has no causal-LM architecture"
            )
        config.architectures = [causal_lm_class]
    if cache is not None:
        cache.write_config(config.to_dict())
    return config


class CachedHFConfig:
    """A text model's config read back from the ``to_dict()`` of its transformers config.

    ``to_dict`` lists every attribute the config's constructor set (defaults
    included), which is all that model code reads; class-level properties of
    transformers' config classes are not there. Held only for configs without
    sub-configs (``can_hold``), so every value is plain data.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        if isinstance(values.get("id2label"), dict):
            # JSON made the integer keys strings; transformers turns them back the same way
            self.id2label = {int(k): v for k, v in values["id2label"].items()}

    @staticmethod
    def can_hold(values: dict[str, Any]) -> bool:
        has_sub_config = any(isinstance(v, dict) and "model_type" in v for v in values.values())
        return bool(values.get("architectures")) and isinstance(values.get("model_type"), str) and not has_sub_config

    @property
    def name_or_path(self) -> str:
        # as in transformers: stored as _name_or_path, which to_dict lists
        return str(self.__dict__.get("_name_or_path", ""))

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self.__dict__["_name_or_path"] = value

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"CachedHFConfig({self.__dict__!r})"


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
