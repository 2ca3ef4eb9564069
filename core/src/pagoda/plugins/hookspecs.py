"""Hook specifications: the contract between core and its plugins.

Every hook is collect-all: each plugin returns a list of spec objects and core
freezes the union into plain registries at start-up, so no hook is dispatched
on the per-step path. pluggy passes an implementation only the arguments it
names, so adding an argument to a hookspec later never breaks an old plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pagoda.plugins.specs import (
        AttentionBackendSpec,
        IOProcessorSpec,
        LogitsProcessorSpec,
        ModelFallbackSpec,
        ModelSpec,
        PlatformSpec,
        QuantizationSpec,
        ReasoningParserSpec,
        StructuredOutputBackendSpec,
        ToolParserSpec,
    )

PROJECT_NAME = "pagoda"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pagoda_register_platforms() -> list[PlatformSpec]:
    """Hardware platforms this plugin provides."""
    raise NotImplementedError


@hookspec
def pagoda_register_model_families() -> list[ModelSpec]:
    """Model architectures (HF ``architectures`` names) this plugin implements."""
    raise NotImplementedError


@hookspec
def pagoda_register_model_fallbacks() -> list[ModelFallbackSpec]:
    """Generic model implementations for architectures no family implements (plugin API 1.1).

    ``model_impl="auto"`` uses the first one when no family implements the
    model's architecture; ``model_impl="transformers"`` asks for the one named
    ``"transformers"``.
    """
    raise NotImplementedError


@hookspec
def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
    """Attention backends this plugin provides."""
    raise NotImplementedError


@hookspec
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    """Quantization methods this plugin provides."""
    raise NotImplementedError


@hookspec
def pagoda_register_io_processors() -> list[IOProcessorSpec]:
    """Input/output processors for pooling models."""
    raise NotImplementedError


@hookspec
def pagoda_register_logits_processors() -> list[LogitsProcessorSpec]:
    """Logits processors that requests may name."""
    raise NotImplementedError


@hookspec
def pagoda_startup(config: Any) -> None:
    """Called once per process after plugins load (general plugins: patches, env setup).

    ``config`` is the engine config when an engine starts, else ``None``.
    """


@hookspec
def pagoda_register_structured_output_backends() -> list[StructuredOutputBackendSpec]:
    """Structured-outputs backends (grammar compilers and matchers); plugin API 1.2."""
    raise NotImplementedError


@hookspec
def pagoda_register_tool_parsers() -> list[ToolParserSpec]:
    """Tool-call parsers for ``tool_choice="auto"`` (``--tool-call-parser NAME``); plugin API 1.3."""
    raise NotImplementedError


@hookspec
def pagoda_register_reasoning_parsers() -> list[ReasoningParserSpec]:
    """Reasoning parsers (``--reasoning-parser NAME``): split thinking from the answer; plugin API 1.4."""
    raise NotImplementedError
