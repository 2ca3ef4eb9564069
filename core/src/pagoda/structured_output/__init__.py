"""Structured outputs: constraints, the backend interface plugins implement, and the manager.

Only the parameter classes load eagerly (SamplingParams needs them without torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from pagoda.structured_output.params import JSON_MAX_WHITESPACE, GuidedDecodingParams, StructuredOutputsParams

_LAZY: dict[str, str] = {
    "CompiledGrammar": "pagoda.structured_output.backend",
    "StructuredOutputBackend": "pagoda.structured_output.backend",
    "StructuredOutputError": "pagoda.structured_output.backend",
    "StructuredOutputMatcher": "pagoda.structured_output.backend",
    "ENTRY_POINT_GROUP": "pagoda.structured_output.manager",
    "RequestStructuredOutput": "pagoda.structured_output.manager",
    "StructuredOutputManager": "pagoda.structured_output.manager",
    "apply_token_bitmask": "pagoda.structured_output.manager",
    # Lark grammars as EBNF (vLLM's convert_lark_to_ebnf), for the backends
    "ebnf_of": "pagoda.structured_output.lark",
    "is_likely_lark": "pagoda.structured_output.lark",
    "lark_to_ebnf": "pagoda.structured_output.lark",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda.structured_output' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["JSON_MAX_WHITESPACE", "GuidedDecodingParams", "StructuredOutputsParams", *_LAZY]
