"""The CPU platform: threads, KV cache budget, dtype choice, config defaults, registration."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.platforms import Platform
from pagoda.plugins import API_VERSION, PlatformSpec, check_api_version
from pagoda_platform_cpu import plugin
from pagoda_platform_cpu.platform import (
    DEFAULT_KVCACHE_GIB,
    GEMM_ENV,
    GEMV_ENV,
    KVCACHE_SPACE_ENV,
    LAYER_OPS_ENV,
    PACKED_LINEAR_ENV,
    THREADS_ENV,
    CpuPlatform,
    GiB,
)


def _host_cpu_flags() -> set[str]:
    # Read independently of the platform's own parser, so the test checks it.
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    return set()


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> CpuPlatform:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv(KVCACHE_SPACE_ENV, raising=False)
    return CpuPlatform()


def _config(**engine_args: object) -> EngineConfig:
    return EngineArgs(**engine_args).create_engine_config()  # type: ignore[arg-type]


def test_probe_says_cpu_can_run() -> None:
    assert CpuPlatform.probe() == (True, "")
    assert issubclass(CpuPlatform, Platform)


def test_entry_point_module_registers_the_cpu_platform() -> None:
    # the platform targets plugin API 1.0; later additive versions keep accepting it
    assert check_api_version(plugin.PAGODA_PLUGIN_API_VERSION) is None
    assert API_VERSION.split(".")[0] == plugin.PAGODA_PLUGIN_API_VERSION.split(".")[0]
    (spec,) = plugin.pagoda_register_platforms()
    assert isinstance(spec, PlatformSpec)
    assert (spec.name, spec.device_type, spec.package) == ("cpu", "cpu", "pagoda-platform-cpu")
    assert spec.load() is CpuPlatform


def test_threads_from_env(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "3")
    assert platform.num_threads() == 3


def test_threads_default_to_the_cores_this_process_may_use(platform: CpuPlatform) -> None:
    assert platform.num_threads() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("raw", "why"), [("four", "is not an integer"), ("0", "must be positive"), ("-2", "must be positive")])
def test_bad_thread_count_is_a_clear_error(
    platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch, raw: str, why: str
) -> None:
    monkeypatch.setenv(THREADS_ENV, raw)
    with pytest.raises(ValueError, match=why) as caught:
        platform.num_threads()
    assert THREADS_ENV in str(caught.value)


def test_init_worker_sets_torch_threads(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv(THREADS_ENV, "1")
    try:
        platform.init_worker(_config())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _resolved(max_model_len: int = 2048, layers: int = 30, kv_heads: int = 3, head_dim: int = 64, **kwargs: object) -> EngineConfig:
    """A config whose model is resolved (as the engine core has it when it sizes the cache): bf16, 16-token blocks."""
    from types import SimpleNamespace

    from pagoda.config import ResolvedModel

    config = _config(block_size=16, **kwargs)
    text = SimpleNamespace(num_attention_heads=9, num_key_value_heads=kv_heads, head_dim=head_dim,
                           num_hidden_layers=layers, hidden_size=576)
    config.resolved_model = ResolvedModel(source=None, hf_config=text, text_config=text, dtype=torch.bfloat16,
                                          max_model_len=max_model_len, vocab_size=0)
    return config


def test_default_kv_budget_follows_the_model(platform: CpuPlatform) -> None:
    from pagoda_platform_cpu.platform import KVCACHE_WEIGHTS_RATIO, MIN_DEFAULT_KVCACHE_BYTES

    config = _resolved()
    # SmolLM2-135M Q4_1's 90 MB of weights: 8x them, not the 4 GiB of a large model
    assert platform.kv_cache_budget_bytes(config, model_bytes=90_000_000, activation_bytes=0) == 720_000_000
    assert platform.kv_cache_budget_bytes(config, 1_000, 0) == MIN_DEFAULT_KVCACHE_BYTES
    # weights of 0.5 GiB or more: the old default, never more
    assert platform.kv_cache_budget_bytes(config, GiB // 2, 0) == int(DEFAULT_KVCACHE_GIB * GiB)
    assert platform.kv_cache_budget_bytes(config, 20 * GiB, 0) == int(DEFAULT_KVCACHE_GIB * GiB)
    assert KVCACHE_WEIGHTS_RATIO * GiB // 2 >= DEFAULT_KVCACHE_GIB * GiB
    # a long context: at least one max_model_len request (2 x 30 layers x 3 heads x 64 x 2 bytes a token)
    long = _resolved(max_model_len=65_536)
    assert platform.kv_cache_budget_bytes(long, 90_000_000, 0) == 65_536 * 2 * 30 * 3 * 64 * 2


def test_explicit_kv_budgets_are_exact_whatever_the_model(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    assert platform.kv_cache_budget_bytes(_resolved(kv_cache_memory_bytes=10_000_000), 20 * GiB, 0) == 10_000_000
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "6")
    assert platform.kv_cache_budget_bytes(_resolved(), 90_000_000, 0) == 6 * GiB


def test_kv_budget_from_env_in_gib(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "0.5")
    assert platform.kv_cache_budget_bytes(_config(), 0, 0) == GiB // 2


def test_kv_budget_from_config_beats_env(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "8")
    config = _config(kv_cache_memory_bytes=123_456_789)
    assert platform.kv_cache_budget_bytes(config, 0, 0) == 123_456_789


@pytest.mark.parametrize(("raw", "why"), [("lots", "is not a number of GiB"), ("0", "must be positive"), ("-1", "must be positive")])
def test_bad_kv_budget_is_a_clear_error(
    platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch, raw: str, why: str
) -> None:
    monkeypatch.setenv(KVCACHE_SPACE_ENV, raw)
    with pytest.raises(ValueError, match=why) as caught:
        platform.kv_cache_budget_bytes(_config(), 0, 0)
    assert KVCACHE_SPACE_ENV in str(caught.value)


def test_dtype_auto_follows_native_bf16_support(platform: CpuPlatform) -> None:
    flags = _host_cpu_flags()
    native_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    expected = torch.bfloat16 if native_bf16 else torch.float32
    # Whatever the checkpoint holds: bf16 is emulated (slow) without native support.
    assert platform.resolve_dtype("auto", torch.bfloat16) == expected
    assert platform.resolve_dtype("auto", None) == expected


@pytest.mark.parametrize(
    ("requested", "expected"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("half", torch.float16)],
)
def test_explicit_dtype_is_honoured(platform: CpuPlatform, requested: str, expected: torch.dtype) -> None:
    assert platform.resolve_dtype(requested, torch.float32) == expected


def test_unknown_dtype_names_the_choices(platform: CpuPlatform) -> None:
    with pytest.raises(ValueError, match="dtype='fp8' is not one of 'auto'"):
        platform.resolve_dtype("fp8", None)


def test_config_defaults_are_returned_not_written(platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagoda_platform_cpu.platform.start_kernel_builds", lambda: None)
    monkeypatch.delenv("PAGODA_CPU_KERNEL_GRAPHS", raising=False)
    config = _config(max_num_seqs=12, max_num_batched_tokens=300)
    before = config.model_dump()
    defaults = platform.config_defaults(config)
    assert config.model_dump() == before
    assert defaults.block_size == 16 and defaults.graphs is True
    assert defaults.graph_sizes == (1, 2, 4, 8, 12)  # max_num_seqs pads into a graph of its own
    assert defaults.max_num_batched_tokens is None  # the user set one: nothing measured
    assert f"{DEFAULT_KVCACHE_GIB} GiB" in defaults.kv_cache_budget_rule
    assert platform.config_defaults(_config(max_num_seqs=256)).graph_sizes == (1, 2, 4, 8, 16, 24, 32)
    monkeypatch.setenv("PAGODA_CPU_KERNEL_GRAPHS", "0")
    off = platform.config_defaults(config)
    assert off.graphs is False and "PAGODA_CPU_KERNEL_GRAPHS" in off.graphs_off_reason


def test_device_is_cpu(platform: CpuPlatform) -> None:
    assert platform.device() == torch.device("cpu")
    assert platform.describe().startswith("cpu (")


@pytest.mark.parametrize(
    ("env", "started"),
    [
        ({}, {"gemm", "layer_ops"}),
        ({GEMM_ENV: "0"}, {"gemv", "layer_ops"}),
        ({PACKED_LINEAR_ENV: "0", LAYER_OPS_ENV: "0"}, set()),
    ],
    ids=["default", "gemm-off", "all-off"],
)
def test_config_starts_the_kernel_builds_the_platform_will_need(
    platform: CpuPlatform, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], started: set[str]
) -> None:
    """Compiles run while the weights load: config_defaults starts them, as the switches choose."""
    from pagoda_platform_cpu import gemm, gemv, layer_ops
    from pagoda_platform_cpu import platform as platform_module

    for name in (GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, LAYER_OPS_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(platform_module, "has_avx512f", lambda: True)
    calls: set[str] = set()
    for label, module in (("gemm", gemm), ("gemv", gemv), ("layer_ops", layer_ops)):
        monkeypatch.setattr(module.EXTENSION, "start", lambda label=label: calls.add(label))
    platform.config_defaults(_config(max_num_batched_tokens=512))
    assert calls == started
