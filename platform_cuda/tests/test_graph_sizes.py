"""CUDA graph capture sizes from the engine config: vLLM's spellings and enforce_eager."""

import pytest

from pagoda.config import EngineArgs
from pagoda_platform_cuda.gpu_config import CAPTURE_SIZES_KEY, resolve_capture_sizes
from pagoda_platform_cuda.platform import CudaPlatform


def test_compilation_config_capture_sizes() -> None:
    extra = {"compilation_config": {"cudagraph_capture_sizes": [16, 1, 4, 4, 999]}}
    assert resolve_capture_sizes(extra, 256) == [1, 4, 16]


def test_flat_key_wins_over_compilation_config() -> None:
    extra = {CAPTURE_SIZES_KEY: [2], "compilation_config": {"cudagraph_capture_sizes": [1, 4]}}
    assert resolve_capture_sizes(extra, 256) == [2]


def test_max_cudagraph_capture_size() -> None:
    assert resolve_capture_sizes({"compilation_config": {"max_cudagraph_capture_size": 20}}, 256) == [1, 2, 4, 8, 16, 20]
    assert resolve_capture_sizes({"compilation_config": {"max_cudagraph_capture_size": 0}}, 256) == []


@pytest.mark.parametrize("bad", [{"compilation_config": [1]}, {"compilation_config": {"max_cudagraph_capture_size": -1}}])
def test_bad_compilation_config_is_named(bad: dict) -> None:
    with pytest.raises(ValueError, match="compilation_config"):
        resolve_capture_sizes(bad, 256)


def test_enforce_eager_after_config_resolution_still_wins() -> None:
    config = EngineArgs(max_num_seqs=8).create_engine_config()
    platform = CudaPlatform()
    platform.check_and_update_config(config)
    assert platform.cuda_graph_capture_sizes(config) == [1, 2, 4, 8]
    config.extra = {**config.extra, "enforce_eager": True}
    assert platform.cuda_graph_capture_sizes(config) == []


def test_typed_engine_arguments_reach_the_capture_sizes() -> None:
    from pagoda.config import EngineArgs
    from pagoda_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform()
    eager = EngineArgs(enforce_eager=True).create_engine_config()
    platform.check_and_update_config(eager)
    assert platform.cuda_graph_capture_sizes(eager) == []
    sized = EngineArgs(cuda_graph_sizes=[4, 1, 300], max_num_seqs=256).create_engine_config()
    platform.check_and_update_config(sized)
    assert platform.cuda_graph_capture_sizes(sized) == [1, 4]
