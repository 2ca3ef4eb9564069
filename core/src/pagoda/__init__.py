"""pagoda: a high-throughput LLM inference and serving engine.

Importing pagoda is cheap: it neither imports torch nor resolves a platform.
The public names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagoda.version import __version__

_LAZY: dict[str, str] = {
    "LLM": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.sampling_params",
    "BeamSearchParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.structured_output.params",
    "GuidedDecodingParams": "pagoda.structured_output.params",
    "RequestOutputKind": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "PoolingParams": "pagoda.pooling_params",
    "PoolingOutput": "pagoda.outputs",
    "PoolingRequestOutput": "pagoda.outputs",
    "EmbeddingOutput": "pagoda.outputs",
    "EmbeddingRequestOutput": "pagoda.outputs",
    "ClassificationOutput": "pagoda.outputs",
    "ClassificationRequestOutput": "pagoda.outputs",
    "ScoringOutput": "pagoda.outputs",
    "ScoringRequestOutput": "pagoda.outputs",
    "TokensPrompt": "pagoda.inputs",
    "TextPrompt": "pagoda.inputs",
    "LLMEngine": "pagoda.engine.llm_engine",
    "AsyncLLM": "pagoda.engine.async_llm",
    "AsyncLLMEngine": "pagoda.engine.async_llm",
    "EngineArgs": "pagoda.config",
    "AsyncEngineArgs": "pagoda.config",
    "ModelRegistry": "pagoda.models.registry",
    "LoRARequest": "pagoda.lora.request",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["__version__", *_LAZY]
