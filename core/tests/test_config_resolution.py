"""pagoda.engine.config_resolution: one function decides every value, each from one default, with its source."""

from __future__ import annotations

import logging

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig, ResolvedModel
from pagoda.engine.config_resolution import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    POOLING_MAX_NUM_BATCHED_TOKENS,
    apply_defaults,
    describe_engine_config,
    resolve_in_engine_core,
)
from pagoda.platforms import Platform, PlatformDefaults


class _Graphs(Platform):
    name = "fake"
    supports_graphs = True


class _NoGraphs(Platform):
    name = "plain"


def _config(runner_type: str = "generate", max_model_len: int = 1024, **engine_args: object) -> EngineConfig:
    config = EngineArgs(**engine_args).create_engine_config()  # type: ignore[arg-type]
    config.resolved_model = ResolvedModel(source=None, hf_config=None, text_config=None, dtype=torch.float32,
                                          max_model_len=max_model_len, vocab_size=0, runner_type=runner_type)
    return config


def test_the_platform_fills_what_the_user_left_open_and_each_value_says_whose_it_is() -> None:
    defaults = PlatformDefaults(block_size=32, max_num_batched_tokens=512, max_num_batched_tokens_source="measured",
                                graphs=True, graph_sizes=(1, 2, 4, 8))
    config = _config(max_num_seqs=4)
    apply_defaults(config, _Graphs(), defaults)
    assert (config.block_size, config.max_num_batched_tokens) == (32, 512)
    assert config.scheduler_config.cuda_graph_sizes == [1, 2, 4]  # none above max_num_seqs
    assert config.sources == {
        "cache_config.block_size": "platform default",
        "scheduler_config.max_num_batched_tokens": "platform default: measured",
        "scheduler_config.cuda_graph_sizes": "platform default",
    }
    user = _config(block_size=64, max_num_batched_tokens=300, cuda_graph_sizes=[3, 1])
    apply_defaults(user, _Graphs(), defaults)
    assert (user.block_size, user.max_num_batched_tokens, user.scheduler_config.cuda_graph_sizes) == (64, 300, [1, 3])
    assert user.sources == {"scheduler_config.cuda_graph_sizes": "user"}


def test_the_engines_own_step_budget_when_the_platform_has_none() -> None:
    config = _config()
    apply_defaults(config, _NoGraphs(), PlatformDefaults())
    assert config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    whole = _config(max_model_len=4096, enable_chunked_prefill=False)
    apply_defaults(whole, _NoGraphs(), PlatformDefaults())
    assert whole.max_num_batched_tokens == 4096  # a whole prompt per step
    assert whole.sources["scheduler_config.max_num_batched_tokens"].startswith("derived")


class _MeasuresInCore(Platform):
    name = "measuring"

    def __init__(self) -> None:
        self.calls = 0

    def engine_core_step_budget(self, config: EngineConfig) -> int:
        self.calls += 1
        return 768


def test_a_budget_the_platform_defers_is_decided_in_the_engine_core_once_and_only_where_open() -> None:
    defaults = PlatformDefaults(max_num_batched_tokens_in_engine_core=True, max_num_batched_tokens_source="its curve")
    platform = _MeasuresInCore()
    config = _config()
    apply_defaults(config, platform, defaults)
    assert config.scheduler_config.max_num_batched_tokens is None and platform.calls == 0  # not in the API process
    source = "platform default: decided in the engine core (its curve)"
    assert config.sources["scheduler_config.max_num_batched_tokens"] == source
    assert f"scheduler_config.max_num_batched_tokens = None ({source})" in describe_engine_config(config, platform, defaults)
    resolve_in_engine_core(config, platform)
    resolve_in_engine_core(config, platform)
    assert (config.max_num_batched_tokens, platform.calls) == (768, 1)
    # the user's budget, a pooling model's, and one without chunked prefill are never deferred
    for cfg in (_config(max_num_batched_tokens=300), _config(runner_type="pooling"),
                _config(enable_chunked_prefill=False)):
        apply_defaults(cfg, platform, defaults)
        resolve_in_engine_core(cfg, platform)
        assert cfg.max_num_batched_tokens in (300, POOLING_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    assert platform.calls == 1


def test_without_chunked_prefill_a_budget_below_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="without chunked prefill a whole prompt must fit"):
        apply_defaults(_config(max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=1024),
                       _NoGraphs(), PlatformDefaults())


def test_a_pooling_model_runs_whole_prompts_without_prefix_caching() -> None:
    config = _config(runner_type="pooling", max_model_len=512)
    apply_defaults(config, _NoGraphs(), PlatformDefaults(max_num_batched_tokens=256))
    sc, cc = config.scheduler_config, config.cache_config
    assert (sc.enable_chunked_prefill, cc.enable_prefix_caching) == (False, False)
    assert config.max_num_batched_tokens == POOLING_MAX_NUM_BATCHED_TOKENS  # not the platform's 256
    own = _config(runner_type="pooling", max_model_len=512, max_num_batched_tokens=600)
    apply_defaults(own, _NoGraphs(), PlatformDefaults(max_num_batched_tokens=256))
    assert own.max_num_batched_tokens == 600


@pytest.mark.parametrize(
    ("platform", "defaults", "args", "source"),
    [
        (_NoGraphs(), PlatformDefaults(graphs=True, graph_sizes=(1,)), {}, "platform default: no decode graphs on plain"),
        (_Graphs(), PlatformDefaults(graphs=False, graphs_off_reason="SWITCHED_OFF=0"), {"cuda_graph_sizes": [1]},
         "platform default: SWITCHED_OFF=0"),
        (_Graphs(), PlatformDefaults(graphs=True, graph_sizes=(1, 2)), {"enforce_eager": True}, "user: enforce_eager"),
    ],
    ids=["platform-without-graphs", "platform-switched-off", "enforce-eager"],
)
def test_every_step_eager(platform: Platform, defaults: PlatformDefaults, args: dict, source: str) -> None:
    config = _config(**args)
    apply_defaults(config, platform, defaults)
    assert config.scheduler_config.cuda_graph_sizes == []
    assert platform.cuda_graph_capture_sizes(config) == []
    assert config.sources["scheduler_config.cuda_graph_sizes"] == source


def test_the_start_up_block_states_every_value_once_with_its_source() -> None:
    config = _config(max_model_len=256, block_size=16, dtype="float32")
    defaults = PlatformDefaults(kv_cache_budget_rule="4 GiB")
    apply_defaults(config, _NoGraphs(), defaults)
    text = describe_engine_config(config, _NoGraphs(), defaults)
    lines = text.splitlines()[1:]
    keys = [line.split(" = ")[0].strip() for line in lines]
    assert len(keys) == len(set(keys))
    sections = (config.model, config.cache_config, config.scheduler_config, config.parallel_config,
                config.device_config, config.load_config, config.structured_outputs_config)
    # the model's dtype, context length, runner and quantization are stated once, resolved (4 lines), + the KV budget
    assert sum(len(type(s).model_fields) for s in sections) + 1 == len(lines)
    assert "  cache_config.block_size = 16 (user)" in lines
    assert "  resolved.max_model_len = 256 (model config)" in lines
    assert "  resolved.dtype = float32 (user)" in lines
    assert "  scheduler_config.max_num_seqs = 256 (default)" in lines
    assert f"  scheduler_config.max_num_batched_tokens = {DEFAULT_MAX_NUM_BATCHED_TOKENS} (default)" in lines
    assert "  kv cache budget = 4 GiB (platform default)" in lines


def test_prepare_engine_config_logs_one_block(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from pagoda.engine import config_resolution

    calls: list[EngineConfig] = []

    class _Recording(_NoGraphs):
        def config_defaults(self, config: EngineConfig) -> PlatformDefaults:
            calls.append(config)
            return PlatformDefaults(block_size=8)

    monkeypatch.setattr(config_resolution, "resolve_platform", lambda device: _Recording())
    config = _config()
    with caplog.at_level(logging.INFO, logger="pagoda.engine.config_resolution"):
        platform = config_resolution.prepare_engine_config(config)
    assert isinstance(platform, _Recording) and calls == [config]
    assert config.block_size == 8
    blocks = [r for r in caplog.records if r.getMessage().startswith("engine config (platform plain):")]
    assert len(blocks) == 1 and "cache_config.block_size = 8 (platform default)" in blocks[0].getMessage()


def test_lora_resolution() -> None:
    """max_cpu_loras follows max_loras; LoRA steps run eagerly; tensor and pipeline parallel layouts serve
    adapters too (each rank its part: tests/test_lora.py)."""
    defaults = PlatformDefaults(graphs=True, graph_sizes=(1, 2, 4))
    config = _config(enable_lora=True, max_loras=3)
    apply_defaults(config, _Graphs(), defaults)
    assert config.lora_config is not None and config.lora_config.max_cpu_loras == 3
    assert config.sources["lora_config.max_cpu_loras"] == "derived: max_loras"
    assert config.scheduler_config.cuda_graph_sizes == []
    assert "enable_lora" in config.sources["scheduler_config.cuda_graph_sizes"]
    assert "lora_config.max_loras = 3" in describe_engine_config(config, _Graphs(), defaults)
    with pytest.raises(ValueError, match="max_cpu_loras=2 must be >= max_loras=3"):
        apply_defaults(_config(enable_lora=True, max_loras=3, max_cpu_loras=2), _Graphs(), defaults)
    parallel = _config(enable_lora=True, tensor_parallel_size=2)
    apply_defaults(parallel, _Graphs(), defaults)
    assert parallel.lora_config is not None and parallel.parallel_config.tensor_parallel_size == 2
