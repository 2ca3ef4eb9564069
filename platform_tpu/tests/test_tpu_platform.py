"""The TPU platform on a machine without torch_xla or TPU chips."""

import importlib.util
import sys

import pytest
import torch
from pagoda.config import EngineArgs
from pagoda_platform_tpu import plugin
from pagoda_platform_tpu.platform import TpuPlatform, token_buckets


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_probe_explains_and_imports_nothing() -> None:
    ok, reason = TpuPlatform.probe()
    assert ok is False
    assert "torch_xla is not installed" in reason
    assert "torch_xla" not in sys.modules


def test_plugin_spec_is_marked_unverified() -> None:
    (spec,) = plugin.pagoda_register_platforms()
    assert spec.name == "tpu" and spec.device_type == "xla" and spec.verified_on_hardware is False
    assert spec.load() is TpuPlatform


def test_config_defaults() -> None:
    from pagoda.config import ResolvedModel
    from pagoda.engine.config_resolution import apply_defaults

    config = EngineArgs(enable_chunked_prefill=False).create_engine_config()
    config.resolved_model = ResolvedModel(source=None, hf_config=None, text_config=None, dtype=torch.bfloat16,
                                          max_model_len=4096, vocab_size=0)
    platform = TpuPlatform()
    defaults = platform.config_defaults(config)
    assert defaults.block_size == 16 and defaults.requires_chunked_prefill is True
    apply_defaults(config, platform, defaults)
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.sources["scheduler_config.enable_chunked_prefill"] == "platform default: required by tpu"
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert token_buckets(config.max_num_batched_tokens) == [16, 32, 64, 128, 256, 512, 1024, 2048]


def test_token_buckets_cover_the_budget() -> None:
    assert token_buckets(100) == [16, 32, 64, 128]
    assert token_buckets(16) == [16]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def test_dtypes() -> None:
    platform = TpuPlatform()
    assert platform.resolve_dtype("auto", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="not supported on platform 'tpu'"):
        platform.resolve_dtype("float16", None)


def test_attention_preference() -> None:
    assert TpuPlatform().attention_backend_preference() == ["xla_paged", "torch_paged"]
