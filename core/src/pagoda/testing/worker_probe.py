"""Helpers for tests that check what a spawned engine process sees."""

from __future__ import annotations

from typing import Any


class ScriptOnlyForCausalLM:
    """Stands for a model class a user registers in their own script."""


def report_worker_view(config: Any, queue: Any) -> None:
    """Run in a spawned process: bootstrap as an engine worker, report what it resolved."""
    from pagoda.engine.worker_bootstrap import init_worker_process
    from pagoda.models.registry import ModelRegistry

    pm, platform = init_worker_process(config)
    cls = ModelRegistry.resolve_model_cls(["ScriptOnlyForCausalLM"])
    queue.put((cls.__name__, platform.name, sorted(pm.loaded_names())))
