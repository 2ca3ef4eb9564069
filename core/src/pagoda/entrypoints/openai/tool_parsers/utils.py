"""Reading tool calls out of text that is still being written.

Tool-call formats wrap JSON objects like ``{"name": "f", "arguments": {...}}``.
While streaming, the scanners here find, in the text so far, each call's name
(once its string is closed) and the raw text of its arguments value (a prefix
of the final one). Raw text only grows as tokens arrive, so the argument
fragments sent to the client join up to exactly what the model wrote: nothing
is re-serialized from a partial parse and nothing sent needs taking back.
``ToolCallDeltaStream`` turns successive readings into the deltas to send.

Each reading walks the text again, but a ``ScanMemo`` lets the scan of an
argument value resume where the previous reading stopped, so a stream costs
about the same per token however long its calls grow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from pagoda.entrypoints.openai.tool_parsers.abstract_tool_parser import make_tool_call_id

_WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """``text[i]`` is a quote: the index after the closing quote, None while the string is open."""
    j = i + 1
    while True:
        # jump to the next quote or backslash in C, not character by character in Python
        m = _STRING_STOP.search(text, j)
        if m is None:
            return None
        if m.group() == '"':
            return m.end()
        j = m.end() + 1  # the escaped character
        if j > len(text):
            return None


class ScanMemo:
    """Where ``scan_value`` got to in containers of a text that only grows (a stream's output so far), so the
    next reading resumes there instead of re-reading each value from its start. One per stream; a text that
    does not extend the last one seen clears it."""

    def __init__(self) -> None:
        self._text = ""
        # value start -> (index to resume at, bracket depth there, end once complete)
        self._states: dict[int, tuple[int, int, int | None]] = {}

    def get(self, text: str, i: int) -> tuple[int, int, int | None] | None:
        if text is not self._text:
            if not text.startswith(self._text):
                self._states.clear()
            self._text = text
        return self._states.get(i)

    def put(self, i: int, resume_at: int, depth: int, end: int | None) -> None:
        self._states[i] = (resume_at, depth, end)


def scan_value(text: str, i: int, memo: ScanMemo | None = None) -> int | None:
    """The index after the JSON value starting at ``text[i]``; None while it may still grow.

    Only brackets and strings are tracked (no full validation): callers that need
    a valid value ``json.loads`` the span once it is complete. ``memo`` (for a text
    that only grows) makes a container's scan resume where the last one stopped.
    """
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        depth = 0
        j = i
        state = memo.get(text, i) if memo is not None else None
        if state is not None:
            if state[2] is not None:
                return state[2]
            j, depth = state[0], state[1]
        while True:
            m = _STRUCTURE.search(text, j)
            if m is None:
                if memo is not None:
                    memo.put(i, len(text), depth, None)
                return None
            c = m.group()
            if c == '"':
                end = _scan_string(text, m.start())
                if end is None:
                    if memo is not None:
                        memo.put(i, m.start(), depth, None)  # the open string is read again next time
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            if depth == 0:
                if memo is not None:
                    memo.put(i, m.end(), 0, m.end())
                return m.end()
            j = m.end()
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    # a number or literal at the very end of the text may still grow
    return j if j < len(text) else None


@dataclass
class CallScan:
    """What an object ``{"name": ..., <arguments key>: ...}`` holds so far."""

    name: str | None = None
    # raw text of the arguments value so far ("" before it starts); a prefix of the final text
    arguments: str = ""
    arguments_complete: bool = False
    # index after the closing brace; None while the object is open
    end: int | None = None
    # the text is not an object of that shape (a key that is not a string, a missing colon, ...)
    error: bool = False


def scan_call_object(text: str, i: int, name_keys: Sequence[str] = ("name",),
                     argument_keys: Sequence[str] = ("arguments", "parameters"),
                     memo: ScanMemo | None = None) -> CallScan:
    """Read the call object starting at ``text[i]`` (a ``{``) as far as the text goes."""
    out = CallScan()
    if i >= len(text):
        return out  # not started yet
    if text[i] != "{":
        out.error = True
        return out
    n = len(text)
    j = i + 1
    seen_arguments = False
    while True:
        j = _skip_ws(text, j)
        if j >= n:
            return out
        c = text[j]
        if c == "}":
            out.end = j + 1
            return out
        if c == ",":
            j += 1
            continue
        if c != '"':
            out.error = True
            return out
        key_end = _scan_string(text, j)
        if key_end is None:
            return out
        try:
            key = json.loads(text[j:key_end])
        except json.JSONDecodeError:
            out.error = True
            return out
        j = _skip_ws(text, key_end)
        if j >= n:
            return out
        if text[j] != ":":
            out.error = True
            return out
        j = _skip_ws(text, j + 1)
        if j >= n:
            return out
        value_end = scan_value(text, j, memo)
        if key in argument_keys and not seen_arguments:
            seen_arguments = True
            out.arguments = text[j: n if value_end is None else value_end]
            out.arguments_complete = value_end is not None
        elif key in name_keys and value_end is not None and text[j] == '"':
            try:
                out.name = json.loads(text[j:value_end])
            except json.JSONDecodeError:
                out.error = True
                return out
        if value_end is None:
            return out
        j = value_end


def scan_call_list(text: str, i: int, name_keys: Sequence[str] = ("name",),
                   argument_keys: Sequence[str] = ("arguments", "parameters"),
                   memo: ScanMemo | None = None) -> tuple[list[CallScan], int | None, bool]:
    """Read a JSON array of call objects starting at ``text[i]`` (a ``[``): (calls so far, index after the closing
    bracket or None while open, error)."""
    if i >= len(text):
        return [], None, False  # not started yet
    if text[i] != "[":
        return [], None, True
    calls: list[CallScan] = []
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return calls, None, False
        c = text[j]
        if c == "]":
            return calls, j + 1, False
        if c == ",":
            j += 1
            continue
        if c != "{":
            return calls, None, True
        scan = scan_call_object(text, j, name_keys, argument_keys, memo)
        calls.append(scan)
        if scan.error:
            return calls, None, True
        if scan.end is None:
            return calls, None, False
        j = scan.end


def partial_marker_len(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallDeltaStream:
    """Successive readings of a growing output (its content, and its calls as (name or None, raw arguments so far))
    -> ``DeltaMessage``s with only what is new.

    A call's first delta carries its index, id, type and name (OpenAI's shape: arguments ``""``, or the first
    fragment when the arguments arrived in the same step); later ones carry argument fragments. A call whose
    name is not known yet, and every call after it, waits. Content and each call's arguments must only grow
    from one reading to the next; a reading that shrinks them sends nothing for that part.
    """

    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self._id_factory = id_factory
        self.content_sent = 0
        # each call's arguments as sent so far
        self.arguments_sent: list[str] = []
        self.ids: list[str] = []
        self.names: list[str] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def update(self, content: str, calls: Sequence[tuple[str | None, str]]) -> DeltaMessage | None:
        new_content = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        pieces: list[DeltaToolCall] = []
        for index, (name, arguments) in enumerate(calls):
            if name is None:
                break
            if index >= len(self.ids):
                self.ids.append(self._id_factory())
                self.names.append(name)
                self.arguments_sent.append(arguments)
                pieces.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                            function=DeltaFunctionCall(name=name, arguments=arguments)))
                continue
            sent = self.arguments_sent[index]
            if len(arguments) > len(sent):
                pieces.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments[len(sent):])))
                self.arguments_sent[index] = arguments
        if not new_content and not pieces:
            return None
        return DeltaMessage(content=new_content or None, tool_calls=pieces)
