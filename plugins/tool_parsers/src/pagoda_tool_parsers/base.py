"""What the parsers here share: streaming by re-reading the text so far.

Each parser says how to read a (possibly unfinished) output into its content and
its calls as (name or None, raw arguments text so far); ``ToolCallDeltaStream``
sends what is new. Content is always a prefix of the text, and a marker only
partly written is held back until it is complete or the output ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagoda.entrypoints.openai.tool_parsers import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ScanMemo,
    ToolCall,
    ToolCallDeltaStream,
    ToolParser,
    make_tool_call_id,
)

Reading = tuple[str, list[tuple[str | None, str]]]


def arguments_json(arguments: Any) -> str:
    """A call's arguments as the JSON string OpenAI sends (a string the model already wrote as JSON stays)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


class StreamingToolParser(ToolParser):
    """A ``ToolParser`` whose streaming diffs successive readings of the output (see ``read``)."""

    # markers the model writes; kept as text when they are special tokens (see adjust_request)
    markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._stream = ToolCallDeltaStream(self.make_id)
        # the output only grows while streaming: scans resume where the last reading stopped
        self.memo = ScanMemo()

    def make_id(self) -> str:
        return make_tool_call_id()

    def tool_call(self, name: str, arguments: Any) -> ToolCall:
        return ToolCall(id=self.make_id(), type="function",
                        function=FunctionCall(name=name, arguments=arguments_json(arguments)))

    def read(self, text: str, final: bool) -> Reading:
        """(content, calls so far) of ``text``; ``final`` when the output has ended (nothing more to wait for)."""
        raise NotImplementedError

    def adjust_request(self, request: Any) -> Any:
        # as vLLM: a marker that is a special token would be dropped by detokenizing, so keep special tokens; only
        # when one of this parser's markers is special here (otherwise the model's other special tokens would leak)
        tools_used = bool(getattr(request, "tools", None)) and getattr(request, "tool_choice", None) != "none"
        if tools_used and request.skip_special_tokens and any(m in self._special_tokens() for m in self.markers):
            return request.model_copy(update={"skip_special_tokens": False})
        return request

    def _special_tokens(self) -> set[str]:
        """The tokens detokenizing skips: added tokens marked special (an added token that is not special, such as
        Qwen's ``<tool_call>``, stays in the text anyway)."""
        tokenizer = self.model_tokenizer
        if tokenizer is None:
            return set()
        special = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                   if getattr(t, "special", False)}
        return special | set(getattr(tokenizer, "all_special_tokens", None) or [])

    def _update(self, reading: Reading) -> DeltaMessage | None:
        message = self._stream.update(*reading)
        # vLLM's bookkeeping fields, for code that reads them
        self.current_tool_id = len(self._stream.ids) - 1
        self.current_tool_name_sent = bool(self._stream.ids)
        self.streamed_args_for_tool = list(self._stream.arguments_sent)
        return message

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int], delta_token_ids: Sequence[int], request: Any,
    ) -> DeltaMessage | None:
        return self._update(self.read(current_text, final=False))

    def finish_streaming(self, current_text: str, request: Any) -> DeltaMessage | None:
        reading = self.read(current_text, final=True)
        if not self._stream.tools_called and not self.extract_tool_calls(current_text, request).tools_called:
            # it never became a call: everything held back is content after all
            reading = (current_text, [])
        return self._update(reading)

    @staticmethod
    def not_called(model_output: str) -> ExtractedToolCallInformation:
        return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
