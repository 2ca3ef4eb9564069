"""What every process the engine starts runs first: the main process's decisions, replayed.

The main process decides once which plugins load and which models a user
registered in their script (``ModelRegistry.register_model``); both travel in
the picklable ``EngineConfig`` so a worker never re-discovers a different set
or loses an in-script registration (a known vLLM pitfall).
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.models.registry import ModelRegistry
from pagoda.platforms import Platform, resolve_platform, set_current_platform
from pagoda.plugins import PluginManager, load_plugins


def init_worker_process(config: EngineConfig) -> tuple[PluginManager, Platform]:
    pm = load_plugins(config.plugins)
    ModelRegistry.replay(config.registered_models)
    platform = resolve_platform(config.device_config.device)
    set_current_platform(platform)
    pm.startup(config)
    return pm, platform
