"""CUDA graph capture sizes from the engine config: the platform's defaults, the user's sizes, enforce_eager."""

import torch

from pagoda.config import EngineArgs, EngineConfig, ResolvedModel
from pagoda.engine.config_resolution import apply_defaults
from pagoda_platform_cuda.platform import CudaPlatform


def _resolved(**engine_args: object) -> EngineConfig:
    config = EngineArgs(**engine_args).create_engine_config()  # type: ignore[arg-type]
    config.resolved_model = ResolvedModel(source=None, hf_config=None, text_config=None, dtype=torch.float16,
                                          max_model_len=512, vocab_size=0)
    platform = CudaPlatform()
    apply_defaults(config, platform, platform.config_defaults(config))
    return config


def test_platform_sizes_unless_the_user_names_some() -> None:
    platform = CudaPlatform()
    assert platform.cuda_graph_capture_sizes(_resolved(max_num_seqs=8)) == [1, 2, 4, 8]
    # sorted, deduplicated, capped at max_num_seqs: a graph larger than any decode batch is never replayed
    sized = _resolved(cuda_graph_sizes=[4, 1, 300, 4], max_num_seqs=256)
    assert platform.cuda_graph_capture_sizes(sized) == [1, 4]
    assert sized.sources["scheduler_config.cuda_graph_sizes"] == "user"


def test_enforce_eager_captures_nothing() -> None:
    eager = _resolved(enforce_eager=True, cuda_graph_sizes=[1, 2])
    assert CudaPlatform().cuda_graph_capture_sizes(eager) == []
    assert eager.sources["scheduler_config.cuda_graph_sizes"] == "user: enforce_eager"
