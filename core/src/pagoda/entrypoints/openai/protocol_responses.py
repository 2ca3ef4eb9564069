"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it).

A Responses request is read into chat messages and a ``ChatCompletionRequest`` (``to_chat_request``), so the
chat template, tool parser, reasoning parser and structured outputs run exactly as they do for chat
completions. OpenAI's fields that would change the output and that pagoda cannot honour (built-in tools,
``background``, ``include``d extras, ...) are refused by name; those that cannot change it (``metadata``,
``user``, ``service_tier``, ``prompt_cache_key``, ...) are accepted, and the unknown ones logged as ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pagoda.entrypoints.openai.errors import validation_error
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, FieldError, _Body

# The item types ``input`` may hold; the other OpenAI item types ask for built-in tools or server state
# pagoda does not have.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")

# Content parts of a message: text only (an image or file would be a different question than the text alone).
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")

# OpenAI's request fields that would change the output, refused when set to anything but their default.
_REFUSED_WHEN_SET: dict[str, tuple[Any, str]] = {
    "background": (False, "background responses are not supported: send the request without background "
                          "(stream it to see progress)"),
    "conversation": (None, "conversations (the Conversations API) are not supported: continue with "
                           "previous_response_id or send the whole input"),
    "prompt": (None, "prompt templates (prompt ids) are not supported: send the instructions and input"),
    "max_tool_calls": (None, "max_tool_calls is not supported: bound the calls with parallel_tool_calls false"),
    "truncation": ("disabled", "truncation 'auto' is not supported: an input over the context is refused (400)"),
    "context_management": (None, "context_management (compaction) is not supported"),
    "moderation": (None, "moderation is not supported: this server runs the model only"),
    "top_logprobs": (0, "logprobs are not supported on /v1/responses (use /v1/chat/completions)"),
}


class InputTextPart(_Body):
    """``input_text`` (a user's), ``output_text`` and ``refusal`` (an assistant's, sent back as history)."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: StrictStr | None = None
    refusal: StrictStr | None = None

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _check_parts(parts: Any, where: str) -> Any:
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES:
                raise FieldError(f"{where}[{i}]: content part type {kind!r} is not supported: this server takes "
                                 f"text only ({', '.join(TEXT_PART_TYPES)})", f"{where}[{i}].type")
    return parts


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputTextPart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _check_parts(value, "content")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.value for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputTextPart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _check_parts(value, "output")

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.value for p in self.output)


class ReasoningTextPart(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Body):
    """A reasoning item sent back as history: the chat templates served here render past assistant turns
    without their reasoning, so it is read and not rendered (as vLLM's chat-template path does)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None

    @model_validator(mode="after")
    def _not_encrypted(self) -> Any:
        if self.encrypted_content is not None:
            raise FieldError("encrypted reasoning content is not supported: this server never produces it",
                             "encrypted_content")
        return self


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_MODELS: dict[str, type[_Body]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                        "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    # as vLLM: a named or required tool_choice constrains the arguments to the schema whatever strict says;
    # under "auto" the tool parser reads the calls the model wrote
    strict: StrictBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class TextFormat(_Body):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema inline (not nested as in
    chat's ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_}}

    def echo(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            body.update(name=self.name, schema=self.schema_, description=self.description, strict=self.strict)
        return body


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: StrictBool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool = False
    include: list[StrictStr] | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    # vLLM's extra sampling parameters (the chat request's names)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    priority: StrictInt = 0
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _items: list[Any] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, (default, reason) in _REFUSED_WHEN_SET.items():
            value = data.get(name)
            if value is not None and value != default:
                raise FieldError(reason, name)
        return data

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError(f"tools[{i}]: tool type {kind!r} is not supported: built-in tools (web_search, "
                                 "file_search, code_interpreter, ...) are not run by this server; only function "
                                 "tools are", f"tools[{i}].type")
        return value

    @model_validator(mode="after")
    def _refused_settings(self) -> Any:
        """Checked here, not in the nested models, so the error names the nested field itself."""
        if self.text.format.type == "json_schema" and self.text.format.schema_ is None:
            raise FieldError('text.format "json_schema" needs a schema (an object)', "text.format.schema")
        if self.text.verbosity is not None:
            raise FieldError("text.verbosity is not supported: no model served here takes a verbosity setting; "
                             "ask for length in the input or bound it with max_output_tokens", "text.verbosity")
        for name in ("summary", "generate_summary"):
            if self.reasoning is not None and getattr(self.reasoning, name) is not None:
                raise FieldError(f"reasoning.{name} is not supported: the reasoning parser returns the model's "
                                 "reasoning text (reasoning items' content), never a summary", f"reasoning.{name}")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Any:
        if self.include:
            raise FieldError(f"include {self.include!r} is not supported: nothing beyond the default output can be "
                             "included", "include")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise FieldError("input must hold at least one item", "input")
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise FieldError(f"tool_choice {choice!r} is not supported: use 'none', 'auto', 'required' or "
                                 '{"type": "function", "name": ...}', "tool_choice")
            names = [t.name for t in self.tools]
            if choice["name"] not in names:
                raise FieldError(f"tool_choice names the function {choice['name']!r}, which is not in tools {names}",
                                 "tool_choice")
        elif choice == "required" and not self.tools:
            raise FieldError("tool_choice 'required' needs tools", "tools")
        return self

    @model_validator(mode="after")
    def _items_parse(self) -> Any:
        """Each item read by its own type, so an error names the item and its field (a union's error would
        list every branch)."""
        if isinstance(self.input, str):
            self._items = [MessageItem(role="user", content=self.input)]
            return self
        items: list[InputItem] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in _ITEM_MODELS:
                raise FieldError(f"input[{i}]: item type {kind!r} is not supported (supported: "
                                 f"{', '.join(INPUT_ITEM_TYPES)})", f"input[{i}].type")
            try:
                items.append(_ITEM_MODELS[kind].model_validate(item))  # type: ignore[arg-type]
            except ValidationError as exc:
                error = validation_error(exc)
                param = f"input[{i}]" + (f".{error.param}" if error.param else "")
                raise FieldError(f"input[{i}] ({kind}): {error.message}", param) from None
        self._items = items
        return self

    def input_items(self) -> list[InputItem]:
        return list(self._items)

    def to_chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response is generated as (``messages``: the whole conversation)."""
        choice = self.tool_choice
        if not self.tools:
            chat_choice: Any = None
        elif isinstance(choice, dict):
            chat_choice = {"type": "function", "function": {"name": choice["name"]}}
        else:
            chat_choice = choice
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "tools": [t.chat_tool() for t in self.tools] or None, "tool_choice": chat_choice,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.text.format.response_format(),
            "stream": self.stream, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed, "stop": self.stop,
            "priority": self.priority, "request_id": self.request_id, "cache_salt": self.cache_salt,
            "structured_outputs": self.structured_outputs, "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
        }
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def input_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items -> chat messages: consecutive function calls join one assistant message's ``tool_calls``, a
    call's output becomes a ``tool`` message, reasoning items are not rendered."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                last["tool_calls"] = [call]  # the text the model wrote before its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up (``previous_response_id``) continues from."""
    items: list[InputItem] = []
    for item in output:
        if item["type"] == "message":
            items.append(MessageItem(role="assistant", content="".join(p.get("text", "") for p in item["content"])))
        elif item["type"] == "function_call":
            items.append(FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                          arguments=item["arguments"]))
    return input_messages(items)

