"""Pythonic tool calls (Llama 3.2, ToolACE, ...): the whole output is a Python list of calls,
``[get_weather(city="Paris"), get_time(zone="CET")]``.

Read with ``ast`` and ``ast.literal_eval`` only: the model's text is never executed. Streaming sends each call
(name and arguments as JSON) once its ``)`` is written and it parses.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import ExtractedToolCallInformation, ToolCall
from pagoda_tool_parsers.base import Reading, StreamingToolParser

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_SKIP = " \t\r\n,"
_OPEN = "([{"
_CLOSE = ")]}"


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    raise ValueError("a call's function must be a name")


def _arguments(call: ast.Call) -> dict[str, Any]:
    if call.args:
        raise ValueError("tool calls take keyword arguments only")
    out: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs are not literal arguments")
        out[keyword.arg] = ast.literal_eval(keyword.value)
    return out


def _parse_call(source: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one call's source text, or None if it is not a call with literal arguments."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call):
            return None
        return _call_name(node.func), json.dumps(_arguments(node), ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _scan_call(text: str, i: int) -> int | None:
    """``text[i]`` is a call's ``(``: the index after its matching ``)``, None while it is open."""
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c in "\"'":
            j += 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return None
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


class PythonicToolParser(StreamingToolParser):
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        source = model_output.strip()
        if not source.startswith("["):
            return self.not_called(model_output)
        try:
            node = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return self.not_called(model_output)
        if not isinstance(node, ast.List) or not node.elts:
            return self.not_called(model_output)
        calls: list[ToolCall] = []
        for element in node.elts:
            if not isinstance(element, ast.Call):
                return self.not_called(model_output)
            try:
                calls.append(self.tool_call(_call_name(element.func), _arguments(element)))
            except (ValueError, TypeError, RecursionError):
                return self.not_called(model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)

    def read(self, text: str, final: bool) -> Reading:
        i = len(text) - len(text.lstrip())
        if i >= len(text):
            return ("" if not final else text), []
        if text[i] != "[":
            return text, []
        calls: list[tuple[str | None, str]] = []
        j = i + 1
        while True:
            while j < len(text) and text[j] in _SKIP:
                j += 1
            if j >= len(text) or text[j] == "]":
                break
            match = _NAME.match(text, j)
            if match is None:
                break
            k = match.end()
            while k < len(text) and text[k] in " \t":
                k += 1
            if k >= len(text) or text[k] != "(":
                break  # the name may still grow, or this is not a call
            end = _scan_call(text, k)
            if end is None:
                break  # sent once complete: a call whose arguments turn out not to be literals stays text
            parsed = _parse_call(text[j:end])
            if parsed is None:
                break
            calls.append(parsed)
            j = end
        return "", calls
