"""Architecture name -> model class, from model-family plugins and in-script registrations.

In-script registrations (``ModelRegistry.register_model``) are kept by the
plugin manager and copied into the engine config, so every worker process the
engine starts knows them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pagoda.models.interface import check_declarations
from pagoda.plugins import ModelFallbackSpec, ModelSpec, get_plugin_manager, import_object

# vLLM's model_impl: "auto" = a family's own implementation, else the transformers fallback.
ModelImpl = Literal["auto", "pagoda", "transformers"]
MODEL_IMPLS: tuple[str, ...] = get_args(ModelImpl)
FALLBACK_NAME = "transformers"
# Named in errors when no fallback is installed (core never imports it).
FALLBACK_DISTRIBUTION = "pagoda-models-transformers"
SCRIPT_FAMILY = "in-script registration"


def _script_models() -> dict[str, ModelSpec]:
    pm = get_plugin_manager()
    store: dict[str, ModelSpec] | None = getattr(pm, "script_models", None)
    if store is None:
        store = {}
        pm.script_models = store  # type: ignore[attr-defined]
    return store


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ModelChoice:
    """Which implementation serves a model, decided once when the model loads."""

    architecture: str
    cls: str  # "module:Class"
    implementation: Literal["pagoda", "transformers"]
    family: str  # the distribution that provides it, or SCRIPT_FAMILY
    # keyword arguments of the class beyond (hf_config, dtype): the fallback's trust_remote_code
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        cls = import_object(self.cls)
        check_declarations(cls)
        return cls

    def describe(self) -> str:
        if self.implementation == "pagoda":
            return f"Serving {self.architecture} with {self.family} (pagoda implementation)"
        return f"Serving {self.architecture} through the transformers fallback ({self.family})"


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

    @staticmethod
    def resolve(
        architectures: list[str],
        model_impl: str = "auto",
        hf_config: Any = None,
        trust_remote_code: bool = False,
    ) -> ModelChoice:
        """The implementation that serves ``architectures`` under ``model_impl`` (vLLM's meaning).

        ``"pagoda"``: a family's own implementation (a plugin's or an in-script registration);
        ``"transformers"``: the transformers fallback; ``"auto"``: the first, else the second.
        ``hf_config`` is what the fallback checks (any object with ``architectures`` when only
        names are known). Raises ``UnsupportedArchitectureError`` naming the installed families
        and the fallback's state.
        """
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl={model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
        if not architectures:
            raise UnsupportedArchitectureError("the model config names no architectures")
        pm = get_plugin_manager()
        if model_impl != "transformers":
            script = _script_models()
            families = pm.model_families()
            for arch in architectures:
                if arch in script:
                    return ModelChoice(arch, script[arch].cls, "pagoda", SCRIPT_FAMILY)
                if arch in families:
                    info = pm.provider_of("model_families", arch)
                    family = (info.distribution or info.name) if info is not None else "in-process plugin"
                    return ModelChoice(arch, families[arch].cls, "pagoda", family)
            if model_impl == "pagoda":
                raise UnsupportedArchitectureError(
                    f"model architecture(s) {architectures} are not implemented by any installed model family "
                    f"(model_impl='pagoda' excludes the transformers fallback). {_installed_families()}"
                )
        fallback = pm.model_fallbacks().get(FALLBACK_NAME)
        if fallback is None:
            raise UnsupportedArchitectureError(
                f"model architecture(s) {architectures} are not implemented by any installed model family, "
                f"and {_fallback_absent()}. {_installed_families()}"
            )
        config = hf_config if hf_config is not None else _NamesOnly(architectures)
        reasons = fallback.reasons_unsupported(config, trust_remote_code)
        info = pm.provider_of("model_fallbacks", fallback.name)
        family = (info.distribution or info.name) if info is not None else "in-process plugin"
        if reasons:
            own = "" if model_impl == "transformers" else "are not implemented by any installed model family, and "
            raise UnsupportedArchitectureError(
                f"model architecture(s) {architectures} {own}cannot be served by the transformers fallback "
                f"({family}): {'; '.join(reasons)}. {_installed_families()}"
            )
        return ModelChoice(
            architectures[0], fallback.cls, "transformers", family, {"trust_remote_code": trust_remote_code}
        )

    @staticmethod
    def architectures() -> list[tuple[str, str, str]]:
        """(architecture, family, implementation) of every architecture a family implements, by name."""
        pm = get_plugin_manager()
        rows = [(arch, SCRIPT_FAMILY, "pagoda") for arch in sorted(_script_models())]
        script = set(_script_models())
        for arch in sorted(pm.model_families()):
            if arch in script:
                continue
            info = pm.provider_of("model_families", arch)
            rows.append((arch, (info.distribution or info.name) if info is not None else "in-process plugin", "pagoda"))
        return rows

    @staticmethod
    def fallback() -> ModelFallbackSpec | None:
        return get_plugin_manager().model_fallbacks().get(FALLBACK_NAME)


@dataclass(frozen=True)
class _NamesOnly:
    """What the fallback checks when only architecture names are known (``pagoda plugins list``)."""

    architectures: list[str]


def _installed_families() -> str:
    pm = get_plugin_manager()
    by_family: dict[str, list[str]] = {}
    for arch, family, _ in ModelRegistry.architectures():
        by_family.setdefault(family, []).append(arch)
    listed = "; ".join(f"{family}: {', '.join(archs)}" for family, archs in by_family.items()) or "none"
    broken = "".join(
        f" Model-family plugin {i.name} ({i.distribution}) failed to load: {i.error}." for i in pm.failed("model_family")
    )
    return f"Installed model families: {listed}.{broken}"


def _fallback_absent() -> str:
    pm = get_plugin_manager()
    failed = [i for i in pm.failed("model_family") if i.distribution == FALLBACK_DISTRIBUTION]
    if failed:
        return f"the transformers fallback ({FALLBACK_DISTRIBUTION}) failed to load: {failed[0].error}"
    if any(i.distribution == FALLBACK_DISTRIBUTION and i.status == "disabled" for i in pm.infos):
        return f"the transformers fallback ({FALLBACK_DISTRIBUTION}) is installed but not selected by PAGODA_PLUGINS"
    return f"the transformers fallback is not installed (pip install {FALLBACK_DISTRIBUTION})"
