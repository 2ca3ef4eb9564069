"""Hermes 2 Pro / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import (
    ExtractedToolCallInformation,
    partial_marker_len,
    scan_call_object,
)
from pagoda_tool_parsers.base import Reading, StreamingToolParser

_WS = " \t\r\n"


class Hermes2ProToolParser(StreamingToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    markers = (tool_call_start_token, tool_call_end_token)
    # vLLM's: a closed block, or the last block left open when the output stopped
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return self.not_called(model_output)
        decoder = json.JSONDecoder()
        try:
            # the object alone: a block cut off in its end tag (max_tokens) still holds a whole call
            raw = [decoder.raw_decode((closed or open_).strip())[0]
                   for closed, open_ in self.tool_call_regex.findall(model_output)]
            calls = [self.tool_call(c["name"], c.get("arguments", c.get("parameters"))) for c in raw]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError):
            # not the format after all: the text is the answer (as vLLM)
            return self.not_called(model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def read(self, text: str, final: bool) -> Reading:
        start = text.find(self.tool_call_start_token)
        if start < 0:
            held = 0 if final else partial_marker_len(text, self.tool_call_start_token)
            return text[: len(text) - held], []
        calls: list[tuple[str | None, str]] = []
        while start >= 0:
            i = start + len(self.tool_call_start_token)
            while i < len(text) and text[i] in _WS:
                i += 1
            if i >= len(text) or text[i] != "{":
                break
            scan = scan_call_object(text, i, memo=self.memo)
            calls.append((scan.name, scan.arguments))
            if scan.error or scan.end is None:
                break
            start = text.find(self.tool_call_start_token, scan.end)
        return text[: text.find(self.tool_call_start_token)], calls
