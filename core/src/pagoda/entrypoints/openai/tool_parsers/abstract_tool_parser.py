"""vLLM's tool-parser interface and registry: how ``tool_choice="auto"`` turns model text into ``tool_calls``.

A parser reads the text a model writes when it calls tools in its own format
(Hermes' ``<tool_call>`` tags, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``, ...).
Parsers come from plugins (hook ``pagoda_register_tool_parsers``) or from a
file given by ``--tool-parser-plugin`` that registers one with
``@ToolParserManager.register_module(NAME)``; ``--tool-call-parser NAME`` picks one.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import uuid
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from pagoda.entrypoints.openai.protocol import DeltaMessage, ExtractedToolCallInformation

logger = logging.getLogger(__name__)


def make_tool_call_id() -> str:
    """vLLM's id of a tool call: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """One instance per choice of one request (streaming keeps its state here), built with the tokenizer.

    ``prev_tool_call_arr``, ``current_tool_id``, ``current_tool_name_sent`` and
    ``streamed_args_for_tool`` are vLLM's bookkeeping fields, kept so parsers
    ported from vLLM run unchanged; pagoda's server does not read them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self.model_tokenizer = tokenizer

    @cached_property
    def vocab(self) -> dict[str, int]:
        return dict(self.model_tokenizer.get_vocab())

    def adjust_request(self, request: Any) -> Any:
        """The request as this parser needs it generated (e.g. ``skip_special_tokens=False`` when its markers are
        special tokens, which detokenizing would otherwise drop). Returns the request (a copy when changed)."""
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """The tool calls in a finished output and the text left as ``content``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls")

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """What ``delta_text`` adds to the streamed message (content and/or tool-call pieces), or None for nothing
        yet (e.g. a marker only partly written)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extract_tool_calls_streaming")

    def finish_streaming(self, current_text: str, request: Any) -> DeltaMessage | None:
        """Beyond vLLM: called once when the output ends, so text held back as a possible marker start (``<tool``
        that never became ``<tool_call>``) is still sent as content. The default holds nothing back."""
        return None


def _is_tool_parser(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, ToolParser)


class ToolParserManager:
    """Name -> parser class: plugins' parsers (hook ``pagoda_register_tool_parsers``) and, first, the ones a
    ``--tool-parser-plugin`` file registered with ``register_module``."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(
        cls, name: str | list[str] | None = None, force: bool = True, module: type[ToolParser] | None = None,
    ) -> Any:
        """Register ``module`` (or, as a decorator, the decorated class) under ``name`` (default: its class name)."""

        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not _is_tool_parser(parser):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            names = [parser.__name__] if name is None else [name] if isinstance(name, str) else list(name)
            for n in names:
                if not force and n in cls.tool_parsers:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.tool_parsers[n] = parser
            return parser

        if module is not None:
            return register(module)
        return register

    @classmethod
    def available(cls) -> list[str]:
        from pagoda.plugins import get_plugin_manager

        return sorted({*cls.tool_parsers, *get_plugin_manager().tool_parsers()})

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name in cls.tool_parsers:
            return cls.tool_parsers[name]
        from pagoda.plugins import get_plugin_manager

        spec = get_plugin_manager().tool_parsers().get(name)
        if spec is None:
            raise KeyError(f"tool call parser {name!r} is not registered; available: {cls.available() or 'none'} "
                           "(install pagoda-tool-parsers, or pass --tool-parser-plugin FILE)")
        parser = spec.load()
        if not _is_tool_parser(parser):
            raise TypeError(f"tool parser {name!r} ({spec.cls}) is not a ToolParser subclass")
        return parser

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run a Python file that registers parsers with ``register_module`` (vLLM's ``--tool-parser-plugin``)."""
        path = Path(plugin_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--tool-parser-plugin {plugin_path!r} is not a file")
        module_name = f"pagoda_tool_parser_plugin_{uuid.uuid5(uuid.NAMESPACE_URL, str(path.resolve())).hex}"
        if module_name in sys.modules:
            return  # imported already (the server checks its flags before loading the model, then builds)
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the tool parser plugin {plugin_path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)

