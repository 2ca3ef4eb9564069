"""The TPU platform on a machine without torch_xla or TPU chips."""

import importlib.util
import sys

import pytest
import torch
from pagoda.config import EngineArgs
from pagoda_platform_tpu import plugin
from pagoda_platform_tpu.platform import TOKEN_BUCKETS_KEY, TpuPlatform, token_buckets


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
    config = EngineArgs(enable_chunked_prefill=False).create_engine_config()
    TpuPlatform().check_and_update_config(config)
    assert config.cache_config.block_size == 16
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert config.extra[TOKEN_BUCKETS_KEY] == [16, 32, 64, 128, 256, 512, 1024, 2048]


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
