"""vLLM's public import paths, served by pagoda (the opt-in ``pagoda-vllm-compat`` distribution).

``from vllm import LLM, SamplingParams`` gives pagoda's own classes, not wrappers: libraries written
for vLLM (Outlines' ``from_vllm_offline``, lm-eval's ``vllm`` model) run on pagoda unchanged. What
pagoda does not implement is refused by pagoda with an error naming the argument.

Importing this package where a real vLLM distribution is installed raises ``ImportError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm._pagoda_guard import VLLM_API_VERSION, install_metadata_finder, real_vllm_distributions, refusal

_real = real_vllm_distributions()
if _real:
    raise ImportError(refusal(_real, "import"))

from pagoda.version import __version__ as _pagoda_version  # noqa: E402 (after the guard, on purpose)

# PEP 440 local version: vLLM's API level, then which pagoda serves it.
__version__ = f"{VLLM_API_VERSION}+pagoda.{_pagoda_version}"
install_metadata_finder(__version__)

# vLLM's top-level names -> the pagoda module that defines each (loaded on first use, like pagoda's own).
_NAMES: dict[str, str] = {
    "LLM": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.sampling_params",
    "RequestOutputKind": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.structured_output.params",
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
    "PromptType": "pagoda.inputs",
    "LLMEngine": "pagoda.engine.llm_engine",
    "AsyncLLMEngine": "pagoda.engine.async_llm",
    "EngineArgs": "pagoda.config",
    "AsyncEngineArgs": "pagoda.config",
    "ModelRegistry": "pagoda.models.registry",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm' (pagoda's vLLM alias) has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_NAMES))


__all__ = ["__version__", *_NAMES]
