"""Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (tokenizer v3 to v7), or
``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). Call ids are Mistral's 9 letters and digits."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import (
    ExtractedToolCallInformation,
    partial_marker_len,
    scan_call_list,
    scan_value,
)
from pagoda_tool_parsers.base import Reading, StreamingToolParser

_WS = " \t\r\n"
_ID_ALPHABET = string.ascii_letters + string.digits


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class MistralToolParser(StreamingToolParser):
    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
    markers = (bot_token, args_token)

    def make_id(self) -> str:
        # Mistral's chat templates refuse ids that are not exactly 9 alphanumeric characters
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        first = model_output.find(self.bot_token)
        if first < 0:
            return self.not_called(model_output)
        calls = []
        try:
            for segment in model_output[first:].split(self.bot_token)[1:]:
                segment = segment.strip()
                if not segment:
                    continue
                if segment.startswith("["):
                    raw = json.loads(segment)
                    calls += [self.tool_call(c["name"], c.get("arguments", c.get("parameters"))) for c in raw]
                else:
                    name, sep, arguments = segment.partition(self.args_token)
                    if not sep or not name.strip():
                        return self.not_called(model_output)
                    calls.append(self.tool_call(name.strip(), json.loads(arguments)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError):
            return self.not_called(model_output)
        if not calls:
            return self.not_called(model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=model_output[:first] or None)

    def read(self, text: str, final: bool) -> Reading:
        start = text.find(self.bot_token)
        if start < 0:
            held = 0 if final else partial_marker_len(text, self.bot_token)
            return text[: len(text) - held], []
        calls: list[tuple[str | None, str]] = []
        while start >= 0:
            i = _skip_ws(text, start + len(self.bot_token))
            if i >= len(text):
                break
            if text[i] == "[":
                scans, end, error = scan_call_list(text, i, ("name",), ("arguments", "parameters"), self.memo)
                calls += [(s.name, s.arguments) for s in scans]
                if error or end is None:
                    break
                start = text.find(self.bot_token, end)
                continue
            args_at = text.find(self.args_token, i)
            next_call = text.find(self.bot_token, i)
            if args_at < 0 or (0 <= next_call < args_at):
                calls.append((None, ""))  # the name is still being written
                break
            name = text[i:args_at].strip()
            j = _skip_ws(text, args_at + len(self.args_token))
            if j >= len(text):
                calls.append((name, ""))
                break
            end_or_none = scan_value(text, j, self.memo)
            calls.append((name, text[j: len(text) if end_or_none is None else end_or_none]))
            if end_or_none is None:
                break
            start = text.find(self.bot_token, end_or_none)
        return text[: text.find(self.bot_token)], calls
