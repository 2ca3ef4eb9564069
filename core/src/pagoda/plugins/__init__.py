"""pagoda's plugin system (pluggy + entry points). See docs/plugins.md."""

from __future__ import annotations

from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.manager import (
    API_VERSION,
    API_VERSION_ATTR,
    ENTRY_POINT_GROUPS,
    PLUGINS_ENV,
    PluginError,
    PluginManager,
    PluginSelectionError,
    check_api_version,
)
from pagoda.plugins.specs import (
    AttentionBackendSpec,
    IOProcessorSpec,
    LoRAResolverSpec,
    LogitsProcessorSpec,
    ModelFallbackSpec,
    ModelSpec,
    PlatformSpec,
    PluginInfo,
    QuantizationSpec,
    ReasoningParserSpec,
    SpecProposerSpec,
    StructuredOutputBackendSpec,
    ToolParserSpec,
    import_object,
)

_manager: PluginManager | None = None


def get_plugin_manager(load: bool = True) -> PluginManager:
    """The process-wide plugin manager; entry points load once per process."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    if load and not _manager.entry_points_loaded:
        _manager.load_entry_points()
    return _manager


def load_plugins(names: list[str] | None) -> PluginManager:
    """Load exactly ``names`` (as decided by the main process) in a worker process."""
    global _manager
    if _manager is None or not _manager.entry_points_loaded:
        _manager = PluginManager()
        _manager.load_entry_points(names=names)
    return _manager


def reset_plugin_manager() -> None:
    """Forget every plugin (tests; a fresh process does not need it)."""
    global _manager
    _manager = None


__all__ = [
    "API_VERSION",
    "API_VERSION_ATTR",
    "ENTRY_POINT_GROUPS",
    "PLUGINS_ENV",
    "AttentionBackendSpec",
    "IOProcessorSpec",
    "LoRAResolverSpec",
    "LogitsProcessorSpec",
    "ModelFallbackSpec",
    "ModelSpec",
    "PlatformSpec",
    "PluginError",
    "PluginInfo",
    "PluginManager",
    "PluginSelectionError",
    "QuantizationSpec",
    "ReasoningParserSpec",
    "SpecProposerSpec",
    "StructuredOutputBackendSpec",
    "ToolParserSpec",
    "check_api_version",
    "get_plugin_manager",
    "hookimpl",
    "import_object",
    "load_plugins",
    "reset_plugin_manager",
]
