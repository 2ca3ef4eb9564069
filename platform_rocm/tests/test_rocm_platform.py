"""The ROCm platform on a machine without a HIP build of torch."""

import pytest
import torch
from pagoda.config import EngineArgs
from pagoda_platform_rocm import plugin
from pagoda_platform_rocm.platform import RocmPlatform


@pytest.mark.skipif(bool(getattr(torch.version, "hip", None)), reason="this torch is a ROCm build")
def test_probe_explains_and_initialises_nothing() -> None:
    ok, reason = RocmPlatform.probe()
    assert ok is False
    assert "not a ROCm (HIP) build" in reason
    assert not torch.cuda.is_initialized()


def test_plugin_spec_is_marked_unverified() -> None:
    (spec,) = plugin.pagoda_register_platforms()
    assert spec.name == "rocm" and spec.device_type == "cuda"
    assert spec.verified_on_hardware is False
    assert spec.load() is RocmPlatform
    assert RocmPlatform.verified_on_hardware is False


def test_config_defaults_match_the_gpu_path() -> None:
    defaults = RocmPlatform().config_defaults(EngineArgs(max_num_seqs=4).create_engine_config())
    assert defaults.block_size == 16
    assert defaults.graph_sizes == (1, 2, 4)


def test_prefers_triton_attention_on_hip() -> None:
    # Triton compiles for AMD GPUs, and torch names HIP devices "cuda".
    assert RocmPlatform().attention_backend_preference() == ["triton_paged", "torch_paged"]
    assert RocmPlatform.device_type == "cuda"
