"""Logits processors named by requests and shipped by plugins.

A plugin registers ``LogitsProcessorSpec(name, "module:Attr")`` through the
``pagoda_register_logits_processors`` hook. A request names one with
``NamedLogitsProcessor("name", *args, **kwargs)`` in
``SamplingParams.logits_processors`` (beside plain callables); the engine
resolves it when the request is added: a class is instantiated with the
arguments (one fresh instance per request, so a stateful processor is never
shared), a function is used as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagoda.plugins import get_plugin_manager


class NamedLogitsProcessor:
    """A reference, by registered name, to a plugin's logits processor (resolved by the engine)."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a logits processor name must be a non-empty string, got {name!r}")
        self.name = name
        self.args = args
        self.kwargs = kwargs

    def resolve(self) -> Callable[..., Any]:
        specs = get_plugin_manager().logits_processors()
        spec = specs.get(self.name)
        if spec is None:
            known = ", ".join(sorted(specs)) or "(none registered)"
            raise ValueError(f"unknown logits processor {self.name!r}; registered logits processors: {known}")
        target = spec.load()
        if isinstance(target, type):
            processor = target(*self.args, **self.kwargs)
        elif self.args or self.kwargs:
            raise ValueError(
                f"logits processor {self.name!r} is a function and takes no constructor arguments; "
                f"got args={self.args!r} kwargs={self.kwargs!r}"
            )
        else:
            processor = target
        if not callable(processor):
            raise ValueError(f"logits processor {self.name!r} ({spec.cls}) is not callable")
        return processor

    def __call__(self, output_ids: list[int], logits: Any) -> Any:
        # Callable only so SamplingParams accepts it; the engine swaps in the real processor.
        raise RuntimeError(f"{self!r} was not resolved: pass the SamplingParams through an engine")

    def __repr__(self) -> str:
        return f"NamedLogitsProcessor({self.name!r})"


def resolve_logits_processors(processors: Sequence[Any] | None) -> list[Callable[..., Any]] | None:
    """Replace every named reference by the processor it names; plain callables pass through."""
    if processors is None:
        return None
    # (plain strings are names too, for callers that build params without SamplingParams' callable check)
    return [
        NamedLogitsProcessor(p).resolve() if isinstance(p, str)
        else p.resolve() if isinstance(p, NamedLogitsProcessor) else p
        for p in processors
    ]
