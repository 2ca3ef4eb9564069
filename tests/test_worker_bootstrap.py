"""In-script model registrations and the plugin selection reach a freshly spawned process."""

from __future__ import annotations

import multiprocessing as mp

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import prepare_engine_config
from pagoda.models.registry import ModelRegistry
from pagoda.testing.worker_probe import ScriptOnlyForCausalLM, report_worker_view


def test_registrations_and_plugins_replayed_in_spawned_process() -> None:
    ModelRegistry.register_model("ScriptOnlyForCausalLM", ScriptOnlyForCausalLM)
    config = EngineArgs(device="cpu").create_engine_config()
    prepare_engine_config(config)
    assert config.registered_models["ScriptOnlyForCausalLM"].endswith(":ScriptOnlyForCausalLM")
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing inherited but the config
    queue = ctx.Queue()
    proc = ctx.Process(target=report_worker_view, args=(config, queue))
    proc.start()
    name, platform, plugins = queue.get(timeout=120)
    proc.join(timeout=60)
    assert name == "ScriptOnlyForCausalLM"
    assert platform == "cpu"
    assert plugins == sorted(config.plugins or [])
