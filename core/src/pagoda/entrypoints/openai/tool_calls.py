"""``tools`` and ``tool_choice`` on chat completions, as vLLM serves them.

- ``"none"``: the template sees the tools, the answer is text.
- a named function: the output is constrained (structured outputs) to that function's ``parameters`` schema
  and answered as one call to it; ``finish_reason`` stays the engine's (``"stop"``), as vLLM and OpenAI do.
- ``"required"``: the output is constrained to a JSON array of ``{"name": <one of the tools>, "parameters":
  <its schema>}`` and answered as those calls, ``finish_reason`` ``"tool_calls"``.
- ``"auto"`` (the default when tools are sent): the model writes calls in its own format and the server's
  tool parser (``--enable-auto-tool-choice --tool-call-parser NAME``) reads them out; without those flags it is
  refused, as vLLM refuses it.

One ``ChoiceToolCalls`` per choice turns the engine's text into the message (``message``) or, streaming, into
the delta of each chunk (``delta``), with OpenAI's tool-call deltas: the first one of a call carries its index,
id, type and name, the next ones argument fragments that join up to the arguments.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from pagoda.entrypoints.openai.structured_outputs import structured_outputs_of
from pagoda.entrypoints.openai.tool_parsers import (
    ScanMemo,
    ToolCallDeltaStream,
    ToolParser,
    ToolParserManager,
    make_tool_call_id,
    scan_call_list,
)
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.params import StructuredOutputsParams

# OpenAI: a function without parameters takes none
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def resolve_tool_parser(enable_auto_tool_choice: bool, tool_call_parser: str | None,
                        tool_parser_plugin: str | None) -> type[ToolParser] | None:
    """The parser class the server starts with (ValueError naming the flag when the flags do not fit)."""
    if tool_parser_plugin:
        ToolParserManager.import_tool_parser(tool_parser_plugin)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if tool_call_parser is None:
        return None
    try:
        return ToolParserManager.get_tool_parser(tool_call_parser)
    except KeyError as exc:
        raise ValueError(f"--tool-call-parser: {exc.args[0]}") from None


def _tool_choice(req: ChatCompletionRequest) -> str | dict[str, Any]:
    # as vLLM: tools without a tool_choice mean "auto"; the protocol already turned "required" over [] into "none"
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


@functools.lru_cache(maxsize=256)
def _check_schema(backend: str, schema_json: str) -> str | None:
    """The backend's complaint about a parameters schema, or None; cached by schema so a client's usual tool set
    is checked once, not on every request."""
    from pagoda.structured_output.manager import load_backend_class

    try:
        load_backend_class(backend).validate(StructuredOutputsParams(json=json.loads(schema_json)))
    except ValueError as exc:
        return str(exc)
    return None


def _parameters(ctx: Any, tools: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """``tools[index]``'s parameters schema, checked by the structured-outputs backend (400 naming the tool)."""
    function = tools[index]["function"]
    param = f"tools[{index}].function.parameters"
    parameters = function.get("parameters")
    if parameters is None:
        return dict(_NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise APIError(f"{param} must be a JSON schema object, got {type(parameters).__name__}", 400, param)
    backend = ctx.engine.config.structured_outputs_config.backend
    problem = _check_schema(backend, json.dumps(parameters, sort_keys=True))
    if problem is not None:
        raise APIError(f"function {function['name']!r} has an invalid parameters schema: {problem}", 400, param)
    return parameters


def _required_schema(ctx: Any, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``"required"``: a non-empty array of calls to the given tools (one with
    ``parallel_tool_calls`` false), their ``$defs`` hoisted to the top so ``$ref``s still resolve."""
    alternatives = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        parameters = dict(_parameters(ctx, tools, i))
        for name, definition in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise APIError(f"tools define $defs {name!r} twice with different schemas, which tool_choice "
                               "'required' cannot combine", 400, f"tools[{i}].function.parameters")
            defs[name] = definition
        alternatives.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ChatToolCalls:
    """How one chat request answers: ``kind`` is none, auto, required or named."""

    kind: str
    request: ChatCompletionRequest
    function_name: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    tool_parser: type[ToolParser] | None = None
    tokenizer: Any = None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the tool-call constraint (required, named); a second constraint is a 400."""
        if self.structured_outputs is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(f"tool_choice {self.request.tool_choice!r} constrains the output to tool calls: it cannot "
                           "be combined with response_format, structured_outputs or guided_* fields", 400,
                           "tool_choice")
        params.structured_outputs = self.structured_outputs
        return params

    def choice(self) -> ChoiceToolCalls:
        parser = self.tool_parser(self.tokenizer) if self.tool_parser is not None else None
        return ChoiceToolCalls(self, parser)


def prepare_tool_calls(ctx: Any, req: ChatCompletionRequest) -> ChatToolCalls:
    """Check ``tools``/``tool_choice`` against the server (400s) and settle how the request answers."""
    choice = _tool_choice(req)
    tools = req.tools or []
    if choice == "none":
        return ChatToolCalls("none", req)
    if choice == "auto":
        if not (ctx.enable_auto_tool_choice and ctx.tool_parser is not None):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           400, "tool_choice")
        # the parser may need the request generated differently (special tokens kept)
        parser = ctx.tool_parser(ctx.tokenizer)
        adjusted = parser.adjust_request(req)
        return ChatToolCalls("auto", adjusted, tool_parser=ctx.tool_parser, tokenizer=ctx.tokenizer)
    if structured_outputs_of(req) is not None:
        raise APIError(f"tool_choice {choice!r} constrains the output to tool calls: it cannot be combined with "
                       "response_format, structured_outputs or guided_* fields", 400, "tool_choice")
    if choice == "required":
        schema = _required_schema(ctx, tools, req.parallel_tool_calls is not False)
        return ChatToolCalls("required", req, structured_outputs=StructuredOutputsParams(json=schema))
    assert isinstance(choice, dict)  # the protocol checked it names one of the tools
    name = choice["function"]["name"]
    index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
    return ChatToolCalls("named", req, function_name=name,
                         structured_outputs=StructuredOutputsParams(json=_parameters(ctx, tools, index)))


def _tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _delta_json(delta: DeltaMessage) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.content is not None:
        out["content"] = delta.content
    if delta.reasoning_content is not None:
        out["reasoning_content"] = delta.reasoning_content
    if delta.tool_calls:
        out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in delta.tool_calls]
    return out


def _required_calls(text: str, memo: ScanMemo) -> list[tuple[str | None, str]] | None:
    """The calls read so far from a ``"required"`` output (an array of {"name", "parameters"}); None if it is not
    one (the constraint makes that happen only when a stop string or max_tokens cut it)."""
    start = len(text) - len(text.lstrip())
    if start == len(text):
        return []
    calls, _end, error = scan_call_list(text, start, ("name",), ("parameters",), memo)
    if error:
        return None
    return [(c.name, c.arguments) for c in calls]


class ChoiceToolCalls:
    """One choice's text -> its message, or its streamed deltas."""

    def __init__(self, request: ChatToolCalls, parser: ToolParser | None) -> None:
        self.request = request
        self.parser = parser
        self.text = ""
        self.token_ids: list[int] = []
        self.stream = ToolCallDeltaStream()
        self.memo = ScanMemo()
        self.tools_called = False

    # -- whole answers -----------------------------------------------------------------------------
    def message(self, text: str, engine_finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(message fields content/tool_calls, finish_reason) for a finished output."""
        kind = self.request.kind
        calls: list[dict[str, Any]] = []
        content: str | None = text
        if kind == "named":
            assert self.request.function_name is not None
            # as vLLM: the constrained text is the arguments, whatever cut it
            calls = [_tool_call(self.request.function_name, text)]
            content = ""
        elif kind == "required":
            # the calls read as a stream reads them, arguments as the model wrote them (the last one as far as
            # it got when max_tokens cut it), so the answer is the same streamed or not (before: a cut-short
            # answer had no calls and the raw JSON as content, a whole one re-serialized arguments)
            found = _required_calls(text, ScanMemo())
            if found:
                calls = [_tool_call(name, arguments) for name, arguments in found if name is not None]
                content = ""
        elif kind == "auto":
            assert self.parser is not None
            info = self.parser.extract_tool_calls(text, self.request.request)
            if info.tools_called:
                calls = [tc.model_dump() for tc in info.tool_calls]
                if self.request.request.parallel_tool_calls is False:
                    calls = calls[:1]
                content = info.content
        self.tools_called = bool(calls)
        return {"content": content, "tool_calls": calls}, self.finish_reason(engine_finish_reason)

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        # vLLM: "tool_calls" when calls were made under auto or required and the output ended by itself;
        # a named function keeps "stop", and a cut-off output keeps "length"
        if engine_finish_reason == "stop" and self.tools_called and self.request.kind in ("auto", "required"):
            return "tool_calls"
        return engine_finish_reason

    # -- streaming ---------------------------------------------------------------------------------
    def start(self) -> dict[str, Any] | None:
        """The delta sent right after the role, before any token: a named call's header."""
        if self.request.kind != "named":
            return None
        assert self.request.function_name is not None
        self.tools_called = True
        return _delta_json(self.stream.update("", [(self.request.function_name, "")]) or DeltaMessage())

    def delta(self, delta_text: str, delta_token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """The delta for one step's new text ({} when nothing can be sent yet)."""
        previous_text, previous_ids = self.text, self.token_ids
        self.text = previous_text + delta_text
        self.token_ids = previous_ids + list(delta_token_ids)
        kind = self.request.kind
        if kind == "none":
            return {"content": delta_text} if delta_text or not finished else {}
        if kind == "named":
            assert self.request.function_name is not None
            message = self.stream.update("", [(self.request.function_name, self.text)])
            return _delta_json(message) if message is not None else {}
        if kind == "required":
            calls = _required_calls(self.text, self.memo)
            if calls is None:
                return {}
            message = self.stream.update("", calls)
            self.tools_called = self.stream.tools_called
            return _delta_json(message) if message is not None else {}
        assert self.parser is not None
        message = self.parser.extract_tool_calls_streaming(
            previous_text, self.text, delta_text, previous_ids, self.token_ids, list(delta_token_ids),
            self.request.request)
        pieces = [message] if message is not None else []
        if finished:
            tail = self.parser.finish_streaming(self.text, self.request.request)
            if tail is not None:
                pieces.append(tail)
        out: dict[str, Any] = {}
        for piece in pieces:
            self._merge(out, piece)
        return out

    def _merge(self, out: dict[str, Any], message: DeltaMessage) -> None:
        if self.request.request.parallel_tool_calls is False:
            message = message.model_copy(update={"tool_calls": [tc for tc in message.tool_calls if tc.index == 0]})
        self.tools_called = self.tools_called or any(tc.id is not None for tc in message.tool_calls)
        piece = _delta_json(message)
        if "content" in piece:
            out["content"] = out.get("content", "") + piece["content"]
        if "reasoning_content" in piece:
            out["reasoning_content"] = out.get("reasoning_content", "") + piece["reasoning_content"]
        if "tool_calls" in piece:
            out.setdefault("tool_calls", []).extend(piece["tool_calls"])


__all__ = ["ChatToolCalls", "ChoiceToolCalls", "prepare_tool_calls", "resolve_tool_parser"]
