"""Architecture name -> model class, from model-family plugins and in-script registrations.

In-script registrations (``ModelRegistry.register_model``) are kept by the
plugin manager and copied into the engine config, so every worker process the
engine starts knows them too.
"""

from __future__ import annotations

from typing import Any

from pagoda.plugins import ModelSpec, get_plugin_manager, import_object


def _script_models() -> dict[str, ModelSpec]:
    pm = get_plugin_manager()
    store: dict[str, ModelSpec] | None = getattr(pm, "script_models", None)
    if store is None:
        store = {}
        pm.script_models = store  # type: ignore[attr-defined]
    return store


class UnsupportedArchitectureError(ValueError):
    pass


class ModelRegistry:
    """vLLM-compatible registry facade (class methods only; state lives in the plugin manager)."""

    @staticmethod
    def register_model(architecture: str, model_cls: type | str, runner: str = "generate") -> None:
        if isinstance(model_cls, str):
            ref = model_cls
        else:
            ref = f"{model_cls.__module__}:{model_cls.__qualname__}"
        _script_models()[architecture] = ModelSpec(architecture=architecture, cls=ref, runner=runner)

    @staticmethod
    def registered_in_script() -> dict[str, str]:
        return {arch: spec.cls for arch, spec in _script_models().items()}

    @staticmethod
    def replay(registrations: dict[str, str]) -> None:
        """Re-apply the main process's in-script registrations (in a worker)."""
        for arch, ref in registrations.items():
            ModelRegistry.register_model(arch, ref)

    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(set(get_plugin_manager().model_families()) | set(_script_models()))

    @staticmethod
    def spec_for(architectures: list[str]) -> ModelSpec:
        script = _script_models()
        families = get_plugin_manager().model_families()
        for arch in architectures:
            if arch in script:
                return script[arch]
            if arch in families:
                return families[arch]
        raise UnsupportedArchitectureError(
            f"model architecture(s) {architectures} are not supported by any installed model-family plugin. "
            f"Registered architectures: {', '.join(ModelRegistry.get_supported_archs()) or 'none'}"
        )

    @staticmethod
    def resolve_model_cls(architectures: list[str]) -> Any:
        return import_object(ModelRegistry.spec_for(architectures).cls)
