"""The CUDA platform on a machine without a usable CUDA GPU, and its device-free config rules."""

import pytest
import torch

from pagoda.config import EngineArgs
from pagoda_platform_cuda import plugin
from pagoda_platform_cuda.gpu_config import default_capture_sizes, kv_budget_from_memory
from pagoda_platform_cuda.platform import CudaPlatform

GiB = 1 << 30
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@no_cuda
def test_probe_explains_and_initialises_nothing() -> None:
    ok, reason = CudaPlatform.probe()
    assert ok is False
    assert "CPU-only build" in reason or "no CUDA device" in reason or "ROCm" in reason
    assert not torch.cuda.is_initialized()


def test_plugin_spec_points_at_the_class() -> None:
    (spec,) = plugin.pagoda_register_platforms()
    assert spec.name == "cuda" and spec.device_type == "cuda"
    assert spec.load() is CudaPlatform


def test_config_defaults() -> None:
    config = EngineArgs(max_num_seqs=20).create_engine_config()
    defaults = CudaPlatform().config_defaults(config)
    assert defaults.block_size == 16
    assert defaults.max_num_batched_tokens == 8192
    assert defaults.graphs is True and defaults.graph_sizes == (1, 2, 4, 8, 16, 20)
    assert "gpu_memory_utilization=0.9" in defaults.kv_cache_budget_rule
    assert CudaPlatform().is_pin_memory_available(config) is True


def test_bad_capture_sizes_are_named() -> None:
    for bad in ([0, 8], "1,2,4", [1.5]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineArgs(cuda_graph_sizes=bad)


def test_default_capture_sizes_cap_at_512() -> None:
    sizes = default_capture_sizes(4096)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert default_capture_sizes(3) == [1, 2, 3]


def test_kv_budget_honours_gpu_memory_utilization() -> None:
    # 80 GiB card, 10 GiB in use (weights), 2 GiB of activations.
    assert kv_budget_from_memory(80 * GiB, 70 * GiB, 0.9, 2 * GiB) == int(72 * GiB) - 12 * GiB
    assert kv_budget_from_memory(80 * GiB, 70 * GiB, 0.5, 2 * GiB) == 28 * GiB


def test_kv_budget_without_room_says_why() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2"):
        kv_budget_from_memory(80 * GiB, 60 * GiB, 0.2, 1 * GiB)


def test_explicit_kv_budget_wins_without_touching_the_device() -> None:
    config = EngineArgs(kv_cache_memory_bytes=123 * GiB).create_engine_config()
    assert CudaPlatform().kv_cache_budget_bytes(config, 0, 0) == 123 * GiB


def test_prefers_triton_attention() -> None:
    assert CudaPlatform().attention_backend_preference()[0] == "triton_paged"
    assert CudaPlatform.supports_graphs is True
