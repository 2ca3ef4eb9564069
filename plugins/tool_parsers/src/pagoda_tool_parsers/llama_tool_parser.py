"""Llama 3.x JSON tool calls: an optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` objects
separated by ``;``."""

from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import ExtractedToolCallInformation, scan_call_object
from pagoda_tool_parsers.base import Reading, StreamingToolParser

_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(StreamingToolParser):
    bot_token = "<|python_tag|>"
    markers = (bot_token,)

    def _calls_start(self, text: str) -> int | None:
        """Where the JSON objects begin, or None when the output is not tool calls."""
        i = len(text) - len(text.lstrip())
        if text.startswith(self.bot_token, i):
            return i + len(self.bot_token)
        return i if text.startswith("{", i) else None

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        start = self._calls_start(model_output)
        if start is None:
            return self.not_called(model_output)
        decoder = json.JSONDecoder()
        calls = []
        i = start
        try:
            while True:
                while i < len(model_output) and model_output[i] in _SEPARATORS:
                    i += 1
                if i >= len(model_output):
                    break
                obj, i = decoder.raw_decode(model_output, i)
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    return self.not_called(model_output)
                calls.append(self.tool_call(obj["name"], obj.get("arguments", obj.get("parameters"))))
        except (json.JSONDecodeError, RecursionError):
            return self.not_called(model_output)
        if not calls:
            return self.not_called(model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)

    def read(self, text: str, final: bool) -> Reading:
        start = self._calls_start(text)
        if start is None:
            rest = text.lstrip()
            if not final and self.bot_token.startswith(rest):
                return "", []  # nothing yet, or the tag only partly written
            return text, []
        calls: list[tuple[str | None, str]] = []
        i = start
        while True:
            while i < len(text) and text[i] in _SEPARATORS:
                i += 1
            if i >= len(text) or text[i] != "{":
                break
            scan = scan_call_object(text, i, memo=self.memo)
            calls.append((scan.name, scan.arguments))
            if scan.error or scan.end is None:
                break
            i = scan.end
        return "", calls
