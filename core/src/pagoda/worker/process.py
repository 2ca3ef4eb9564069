"""Set-up of a process built from the (pickled) engine config: a worker rank or an engine-core process.

The main process decides the plugins, the in-script models and the platform once
(``pagoda.engine.config_resolution``); every other process replays those decisions
from the config instead of deciding again. Executors call this at the bottom of
the stack, so they never import the engine above them.
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.models.registry import ModelRegistry
from pagoda.platforms import Platform, resolve_platform, set_current_platform
from pagoda.plugins import load_plugins


def replay_main_process_decisions(config: EngineConfig) -> None:
    """The main process's plugins and in-script models, in this process.

    A no-op in the main process itself; a worker or engine-core process loads
    exactly ``config.plugins`` and re-registers ``config.registered_models``, so
    a ``ModelRegistry.register_model`` made in a user's script reaches it (vLLM
    loses those in its workers).
    """
    load_plugins(config.plugins)
    known = ModelRegistry.registered_in_script()
    ModelRegistry.replay({arch: ref for arch, ref in config.registered_models.items() if known.get(arch) != ref})


def init_worker_process(config: EngineConfig, platform_name: str) -> Platform:
    """A worker process's start: the engine's plugins and in-script models, then its platform."""
    replay_main_process_decisions(config)
    platform = resolve_platform(platform_name)
    set_current_platform(platform)
    return platform
