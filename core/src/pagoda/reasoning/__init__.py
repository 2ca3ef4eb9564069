"""Reasoning parsers (vLLM's ``vllm.reasoning``): the interface plugins implement and the registry by name."""

from pagoda.reasoning.abs_reasoning_parsers import (
    ENTRY_POINT_GROUP,
    ReasoningParser,
    ReasoningParserError,
    available_reasoning_parsers,
    get_reasoning_parser,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ReasoningParser",
    "ReasoningParserError",
    "available_reasoning_parsers",
    "get_reasoning_parser",
]
