"""Small, picklable descriptions that plugins hand to core.

Heavy code (model classes, kernels, device runtimes) is referenced by a
``"module:Attr"`` string and imported only when chosen, so discovering plugins
stays cheap and never touches a device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


def import_object(ref: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute."""
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"expected 'module:Attr', got {ref!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class PlatformSpec:
    """A hardware platform. ``cls`` names a ``pagoda.platforms.Platform`` subclass."""

    name: str
    cls: str
    device_type: str
    # Distribution a user installs to get this platform (used in error messages).
    package: str
    # Higher wins when several platforms can run here and none is forced.
    priority: int = 0
    verified_on_hardware: bool = True

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class ModelSpec:
    """One architecture name (as in a HF ``config.json``) and its implementation."""

    architecture: str
    cls: str
    # "generate": a decoder whose logits are sampled; "pooling": a model whose class inherits
    # ``pagoda.models.interface.PoolingModel`` and carries a ``pooler`` (pagoda.pooling), e.g. an encoder. Read by
    # pagoda.pooling.resolve to pick the runner (vLLM's runner="auto").
    runner: str = "generate"

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class ModelFallbackSpec:
    """A generic implementation that serves architectures no family implements (vLLM's ``model_impl="transformers"``).

    ``cls`` names the model class, built as ``cls(hf_config, dtype, trust_remote_code=...)``;
    ``check`` names ``check(hf_config, trust_remote_code) -> list[str]``, the reasons the
    fallback cannot serve that config (empty: it can). Both are imported only when a model
    asks for the fallback (or ``pagoda plugins list`` names an architecture).
    """

    name: str
    cls: str
    check: str
    # Shown in `pagoda plugins list` and in errors: what the fallback serves, in words.
    description: str = ""

    def load(self) -> type:
        return import_object(self.cls)

    def reasons_unsupported(self, hf_config: Any, trust_remote_code: bool = False) -> list[str]:
        reasons: list[str] = import_object(self.check)(hf_config, trust_remote_code)
        return reasons


@dataclass(frozen=True)
class AttentionBackendSpec:
    name: str
    cls: str
    # Device types the backend can run on ("cpu", "cuda", ...).
    device_types: tuple[str, ...] = ("cpu",)

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class QuantizationSpec:
    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class StructuredOutputBackendSpec:
    """A structured-outputs backend (``cls``: a ``pagoda.structured_output.StructuredOutputBackend`` subclass)."""

    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class ToolParserSpec:
    """A tool-call parser (``cls``: a ``pagoda.entrypoints.openai.tool_parsers.ToolParser`` subclass) that
    ``--tool-call-parser NAME`` picks."""

    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class ReasoningParserSpec:
    """A reasoning parser (``cls``: a ``pagoda.reasoning.ReasoningParser`` subclass) that ``--reasoning-parser NAME``
    picks."""

    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class SpecProposerSpec:
    """A speculative decoding proposer (``cls``: a ``pagoda.spec_decode.Proposer`` subclass) that
    ``speculative_config={"method": NAME}`` picks."""

    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class IOProcessorSpec:
    name: str
    cls: str

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class LoRAResolverSpec:
    """A LoRA resolver (vLLM's ``LoRAResolver``): finds an adapter a request names that nobody loaded yet."""

    name: str
    cls: str  # "module:Class" of a pagoda.lora.resolver.LoRAResolver, built with no arguments

    def load(self) -> type:
        return import_object(self.cls)


@dataclass(frozen=True)
class LogitsProcessorSpec:
    """A logits processor that requests can ask for by name."""

    name: str
    cls: str

    def load(self) -> Any:
        return import_object(self.cls)


@dataclass
class PluginInfo:
    """What ``pagoda plugins list`` shows for one plugin."""

    name: str
    kind: str
    distribution: str | None
    version: str | None
    api_version: str | None
    status: str  # "loaded" | "error" | "incompatible" | "disabled"
    error: str | None = None
    traceback: str | None = None
    provides: list[str] = field(default_factory=list)
    entry_point: str | None = None
