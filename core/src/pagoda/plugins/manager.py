"""Loads plugins from entry points into one pluggy manager and freezes their specs.

We read entry points ourselves rather than through pluggy's
``load_setuptools_entrypoints``: that one keys plugins by entry-point name (a
second distribution with the same name is silently dropped) and lets one import
error abort every plugin after it. Here each plugin gets a record with its
status, error and traceback, and a broken plugin never takes down the others.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from pagoda import envs
from pagoda.plugins import hookspecs
from pagoda.plugins.specs import (
    AttentionBackendSpec,
    IOProcessorSpec,
    LogitsProcessorSpec,
    LoRAResolverSpec,
    ModelFallbackSpec,
    ModelSpec,
    PlatformSpec,
    PluginInfo,
    QuantizationSpec,
    ReasoningParserSpec,
    SpecProposerSpec,
    StructuredOutputBackendSpec,
    ToolParserSpec,
)

logger = logging.getLogger(__name__)

# MAJOR.MINOR. A plugin written for 1.x loads on any core 1.y with y >= x;
# core adds hooks and hook arguments only additively within a major version.
# 1.1: pagoda_register_model_fallbacks. 1.2: pagoda_register_structured_output_backends.
# 1.3: pagoda_register_tool_parsers. 1.4: pagoda_register_reasoning_parsers. 1.5: pagoda_add_env_vars
# (and pagoda_startup became historic: a plugin registered late is called too).
# 1.6: pagoda_register_lora_resolvers and pagoda_register_spec_proposers.
API_VERSION = "1.6"
API_VERSION_ATTR = "PAGODA_PLUGIN_API_VERSION"
PLUGINS_ENV = "PAGODA_PLUGINS"

# One entry-point group per kind, so `pagoda plugins list` can show kinds
# without importing anything and a process can load only what it needs.
ENTRY_POINT_GROUPS: dict[str, str] = {
    "platform": "pagoda.platforms",
    "model_family": "pagoda.model_families",
    "attention_backend": "pagoda.attention_backends",
    "quantization": "pagoda.quantization",
    "io_processor": "pagoda.io_processors",
    "structured_output_backend": "pagoda.structured_output_backends",
    "tool_parser": "pagoda.tool_parsers",
    "reasoning_parser": "pagoda.reasoning_parsers",
    "logits_processor": "pagoda.logits_processors",
    "lora_resolver": "pagoda.lora_resolvers",
    "spec_proposer": "pagoda.spec_proposers",
    "general": "pagoda.general",
}

# hook name -> (spec type, how a spec is shown in `provides`)
_REGISTER_HOOKS: dict[str, tuple[type, str]] = {
    "pagoda_register_platforms": (PlatformSpec, "name"),
    "pagoda_register_model_families": (ModelSpec, "architecture"),
    "pagoda_register_model_fallbacks": (ModelFallbackSpec, "name"),
    "pagoda_register_attention_backends": (AttentionBackendSpec, "name"),
    "pagoda_register_quantization_methods": (QuantizationSpec, "name"),
    "pagoda_register_io_processors": (IOProcessorSpec, "name"),
    "pagoda_register_structured_output_backends": (StructuredOutputBackendSpec, "name"),
    "pagoda_register_tool_parsers": (ToolParserSpec, "name"),
    "pagoda_register_reasoning_parsers": (ReasoningParserSpec, "name"),
    "pagoda_register_logits_processors": (LogitsProcessorSpec, "name"),
    "pagoda_register_lora_resolvers": (LoRAResolverSpec, "name"),
    "pagoda_register_spec_proposers": (SpecProposerSpec, "name"),
}


class PluginError(RuntimeError):
    """A plugin could not be selected, loaded or used."""


class PluginSelectionError(PluginError):
    """``PAGODA_PLUGINS`` names a plugin that is not installed."""


def supported_api_versions() -> str:
    major, minor = API_VERSION.split(".")
    return f"{major}.0 to {major}.{minor}"


def check_api_version(declared: object) -> str | None:
    """Return why ``declared`` is incompatible with this core, or None if it is fine."""
    if declared is None:
        return (
            f"the plugin does not declare {API_VERSION_ATTR}; "
            f"this pagoda-core supports plugin API {supported_api_versions()}"
        )
    try:
        major, minor = (int(p) for p in str(declared).split("."))
    except ValueError:
        return (
            f"{API_VERSION_ATTR}={declared!r} is not of the form 'MAJOR.MINOR'; "
            f"this pagoda-core supports plugin API {supported_api_versions()}"
        )
    core_major, core_minor = (int(p) for p in API_VERSION.split("."))
    if major != core_major or minor > core_minor:
        return (
            f"the plugin targets plugin API {declared} but this pagoda-core "
            f"(plugin API {API_VERSION}) supports {supported_api_versions()}"
        )
    return None


def requested_plugin_names(env: Mapping[str, str] | None = None) -> list[str] | None:
    """Names from ``PAGODA_PLUGINS`` (in ``env``, default ``os.environ``): None (unset) means all, [] means none."""
    if env is None:
        return envs.PAGODA_PLUGINS
    names: list[str] | None = envs.ENVIRONMENT_VARIABLES[PLUGINS_ENV].get(env)
    return names


@dataclass(frozen=True)
class _Candidate:
    name: str
    kind: str
    group: str
    value: str
    distribution: str | None
    version: str | None
    entry_point: Any


def _discover(kinds: Iterable[str]) -> list[_Candidate]:
    from importlib_metadata import entry_points

    # One scan of the installed distributions for every group: entry_points(group=...) reads every
    # distribution's entry_points.txt on each call, and the 12 groups cost 0.7-0.8 s of each process's
    # start-up (240 distributions, 2 Zen 3 vCPUs) against ~0.06 s for one scan.
    installed = entry_points()
    found: list[_Candidate] = []
    for kind in kinds:
        group = ENTRY_POINT_GROUPS[kind]
        for ep in installed.select(group=group):
            dist = getattr(ep, "dist", None)
            found.append(
                _Candidate(
                    name=ep.name,
                    kind=kind,
                    group=group,
                    value=ep.value,
                    distribution=dist.name if dist is not None else None,
                    version=dist.version if dist is not None else None,
                    entry_point=ep,
                )
            )
    # Several dists may install the same distribution twice on sys.path (e.g. an
    # editable and a regular install); keep one record per (dist, group, name).
    unique: dict[tuple[Any, ...], _Candidate] = {}
    for c in found:
        unique.setdefault((c.distribution, c.group, c.name, c.value), c)
    return list(unique.values())


def _refuse_registration_wrappers(pm: pluggy.PluginManager, plugin: Any) -> None:
    # Registration hooks are called one plugin at a time (to attribute what each
    # provides), so a wrapper around them would only ever see its own plugin's
    # results; refuse it rather than register something that quietly does nothing.
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.name not in _REGISTER_HOOKS:
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                raise ValueError(
                    f"{caller.name} is implemented as a wrapper by {impl.function.__qualname__}; "
                    "registration hooks take plain implementations only"
                )


def _plugin_key(info: PluginInfo) -> str:
    """The name a plugin is registered under in pluggy (unique per distribution, kind and name)."""
    return f"{info.distribution or 'in-process'}::{info.kind}::{info.name}"


class PluginManager:
    """The process's plugins: one pluggy manager plus a record per plugin."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        # historic: every plugin this manager registers, now or later, declares its variables at once
        self._pm.hook.pagoda_add_env_vars.call_historic(kwargs={"registry": envs.REGISTRY})
        self.infos: list[PluginInfo] = []
        self._specs: dict[str, list[Any]] | None = None
        self._objects: dict[str, Any] = {}
        self.entry_points_loaded = False
        self.loading_entry_points = False

    # -- registration -------------------------------------------------------
    def register(
        self,
        plugin: Any,
        name: str,
        kind: str = "general",
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
    ) -> PluginInfo:
        """Register an object (module or instance) carrying ``@hookimpl`` functions.

        The API version is checked first; an incompatible plugin is recorded
        and refused, never half-registered.
        """
        declared = getattr(plugin, API_VERSION_ATTR, None)
        info = PluginInfo(
            name=name,
            kind=kind,
            distribution=distribution,
            version=version,
            api_version=None if declared is None else str(declared),
            status="loaded",
            entry_point=entry_point,
        )
        problem = check_api_version(declared)
        if problem is not None:
            info.status = "incompatible"
            info.error = f"plugin {name!r} refused: {problem}"
            logger.error(info.error)
            self.infos.append(info)
            return info
        key = _plugin_key(info)
        try:
            self._pm.register(plugin, name=key)
            self._pm.check_pending()
            _refuse_registration_wrappers(self._pm, plugin)
        except Exception as exc:  # a misspelled hook, a bad signature
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            info.status = "error"
            info.error = f"{type(exc).__name__}: {exc}"
            info.traceback = traceback.format_exc()
            self.infos.append(info)
            return info
        self._objects[key] = plugin
        self.infos.append(info)
        self._specs = None
        return info

    def load_entry_points(
        self,
        names: list[str] | None | str = "env",
        kinds: Iterable[str] | None = None,
    ) -> None:
        """Discover and register installed plugins.

        ``names``: ``"env"`` reads ``PAGODA_PLUGINS``; None loads all; a list
        loads exactly those (an unknown name is an error).
        """
        self.loading_entry_points = True
        try:
            self._load_entry_points(names, kinds)
        finally:
            self.loading_entry_points = False

    def _load_entry_points(self, names: list[str] | None | str, kinds: Iterable[str] | None) -> None:
        selected = requested_plugin_names() if names == "env" else names
        kinds = list(ENTRY_POINT_GROUPS) if kinds is None else list(kinds)
        candidates = _discover(kinds)
        if selected is not None:
            known = {c.name for c in candidates} | {c.distribution for c in candidates if c.distribution}
            unknown = [n for n in selected if n not in known]
            if unknown:
                available = ", ".join(sorted({c.name for c in candidates})) or "(none installed)"
                raise PluginSelectionError(
                    f"{PLUGINS_ENV} names plugin(s) that are not installed: "
                    f"{', '.join(unknown)}. Installed plugins: {available}"
                )
        for c in candidates:
            if selected is not None and c.name not in selected and c.distribution not in selected:
                self.infos.append(
                    PluginInfo(
                        name=c.name, kind=c.kind, distribution=c.distribution,
                        version=c.version, api_version=None, status="disabled",
                        error=f"not selected by {PLUGINS_ENV}", entry_point=c.value,
                    )
                )
                continue
            try:
                obj = c.entry_point.load()
            except Exception as exc:
                self.infos.append(
                    PluginInfo(
                        name=c.name, kind=c.kind, distribution=c.distribution,
                        version=c.version, api_version=None, status="error",
                        error=f"failed to import {c.value}: {type(exc).__name__}: {exc}",
                        traceback=traceback.format_exc(), entry_point=c.value,
                    )
                )
                logger.warning("plugin %s (%s) failed to import: %s", c.name, c.distribution, exc)
                continue
            self.register(
                obj, name=c.name, kind=c.kind, distribution=c.distribution,
                version=c.version, entry_point=c.value,
            )
        self.entry_points_loaded = True
        self._specs = None

    # -- frozen registries --------------------------------------------------
    def _collect(self) -> dict[str, list[Any]]:
        """Call every registration hook through pluggy, one plugin at a time.

        The implementations are pluggy's (``hook.get_hookimpls()``), so
        ``specname=`` ones count; calling them a plugin at a time keeps what a
        plugin provided, and its failure, attributed to that plugin alone: one
        plugin raising never hides the others. Providers of a hook are taken in
        pluggy's priority classes (``tryfirst``, plain, ``trylast``) and, within a
        class, in registration order, so the first provider of a name wins.
        """
        if self._specs is not None:
            return self._specs
        loaded = {
            key: info
            for info in self.infos
            if info.status == "loaded" and (key := _plugin_key(info)) in self._objects
        }
        order = {key: i for i, key in enumerate(self._objects)}
        provided: dict[str, dict[str, list[Any]]] = {key: {} for key in loaded}
        providers = {hook: self._providers(hook, order) for hook in _REGISTER_HOOKS}
        for hook, (spec_type, _label) in _REGISTER_HOOKS.items():
            for key in providers[hook]:
                if key not in provided:  # not loaded, or an earlier hook of it failed
                    continue
                info = loaded[key]
                try:
                    result = self._call_one(hook, key)
                    for item in result:
                        if not isinstance(item, spec_type):
                            raise TypeError(
                                f"{hook} returned {type(item).__name__}, expected {spec_type.__name__}"
                            )
                except Exception as exc:
                    info.status = "error"
                    info.error = f"a registration hook failed: {type(exc).__name__}: {exc}"
                    info.traceback = traceback.format_exc()
                    del provided[key]
                    continue
                provided[key][hook] = result
        # Only now, once every plugin that failed is known, so a failed plugin adds nothing.
        specs = {
            hook: [spec for key in providers[hook] for spec in provided.get(key, {}).get(hook, [])]
            for hook in _REGISTER_HOOKS
        }
        for key, results in provided.items():
            loaded[key].provides = [
                f"{hook.removeprefix('pagoda_register_')}:{getattr(spec, _REGISTER_HOOKS[hook][1])}"
                for hook, result in results.items()
                for spec in result
            ]
        self._specs = specs
        return specs

    def _providers(self, hook: str, order: Mapping[str, int]) -> list[str]:
        """Keys of the plugins implementing ``hook``: tryfirst ones, plain ones, trylast ones,
        each class in registration order."""
        rank: dict[str, int] = {}
        for impl in getattr(self._pm.hook, hook).get_hookimpls():
            r = 0 if impl.tryfirst else 2 if impl.trylast else 1
            rank[impl.plugin_name] = min(r, rank.get(impl.plugin_name, r))
        return sorted(rank, key=lambda key: (rank[key], order.get(key, len(order))))

    def _call_one(self, hook: str, key: str) -> list[Any]:
        """Plugin ``key``'s implementations of ``hook``, as pluggy holds them, called in
        pluggy's call order, results flattened.

        Not ``pm.subset_hook_caller``: in pluggy 1.x it drops the other plugins by
        looking the hook's name up on them (so it keeps their ``specname=``
        implementations) and needs hashable plugin objects.
        """
        out: list[Any] = []
        for impl in reversed(getattr(self._pm.hook, hook).get_hookimpls()):
            if impl.plugin_name != key:
                continue
            returned = impl.function()  # registration hooks take no arguments
            if returned is not None:
                out.extend(returned)
        return out

    def _by_name(self, hook: str, attr: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for spec in self._collect()[hook]:
            key = getattr(spec, attr)
            # First one wins; a second provider of the same name is reported, never
            # silently swapped in.
            if key in out:
                logger.warning("%s %r is provided twice; keeping the first", hook, key)
                continue
            out[key] = spec
        return out

    def platforms(self) -> dict[str, PlatformSpec]:
        return self._by_name("pagoda_register_platforms", "name")

    def model_families(self) -> dict[str, ModelSpec]:
        return self._by_name("pagoda_register_model_families", "architecture")

    def model_fallbacks(self) -> dict[str, ModelFallbackSpec]:
        return self._by_name("pagoda_register_model_fallbacks", "name")

    def provider_of(self, kind: str, name: str) -> PluginInfo | None:
        """The loaded plugin whose ``provides`` lists ``kind:name`` (e.g. ``model_families:LlamaForCausalLM``)."""
        self._collect()
        wanted = f"{kind}:{name}"
        return next((i for i in self.infos if i.status == "loaded" and wanted in i.provides), None)

    def attention_backends(self) -> dict[str, AttentionBackendSpec]:
        return self._by_name("pagoda_register_attention_backends", "name")

    def quantization_methods(self) -> dict[str, QuantizationSpec]:
        return self._by_name("pagoda_register_quantization_methods", "name")

    def lora_resolvers(self) -> dict[str, LoRAResolverSpec]:
        return self._by_name("pagoda_register_lora_resolvers", "name")

    def io_processors(self) -> dict[str, IOProcessorSpec]:
        return self._by_name("pagoda_register_io_processors", "name")

    def structured_output_backends(self) -> dict[str, StructuredOutputBackendSpec]:
        return self._by_name("pagoda_register_structured_output_backends", "name")

    def tool_parsers(self) -> dict[str, ToolParserSpec]:
        return self._by_name("pagoda_register_tool_parsers", "name")

    def reasoning_parsers(self) -> dict[str, ReasoningParserSpec]:
        return self._by_name("pagoda_register_reasoning_parsers", "name")

    def logits_processors(self) -> dict[str, LogitsProcessorSpec]:
        return self._by_name("pagoda_register_logits_processors", "name")

    def spec_proposers(self) -> dict[str, SpecProposerSpec]:
        return self._by_name("pagoda_register_spec_proposers", "name")

    def loaded_names(self) -> list[str]:
        return [i.name for i in self.infos if i.status == "loaded" and i.distribution]

    def failed(self, kind: str | None = None) -> list[PluginInfo]:
        return [
            i for i in self.infos
            if i.status in ("error", "incompatible") and (kind is None or i.kind == kind)
        ]

    def startup(self, config: Any = None) -> None:
        """Call ``pagoda_startup`` on every plugin, and on each one registered later (historic)."""
        self._pm.hook.pagoda_startup.call_historic(kwargs={"config": config})

    @property
    def hook(self) -> Any:
        return self._pm.hook
