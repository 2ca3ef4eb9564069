"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

The names are Anthropic's, and vLLM's (``vllm.entrypoints.anthropic.protocol``). Unknown fields that cannot
change the output (``service_tier``, ...) are accepted and logged once as ignored, as the OpenAI bodies'
are; Anthropic's fields that ask for something this server cannot do are refused by name
(``REFUSED_FIELDS``), and so are content blocks it cannot read (images, documents) and server tools.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from pagoda.entrypoints.openai.protocol import FieldError, _log_ignored

# Anthropic's fields that would change the answer in a way this server cannot: a set value is a 400 naming it.
REFUSED_FIELDS: dict[str, str] = {
    "mcp_servers": "mcp_servers is not supported: this server runs the model only, it connects to no MCP server",
    "container": "container is not supported: this server runs no code-execution container",
    "context_management": "context_management is not supported: this server does not edit the conversation; "
                          "send the context you want the model to see",
}

# Content block types a request may hold, and what each is refused for when it cannot be read.
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_REFUSED_BLOCKS: dict[str, str] = {
    "image": "image content is not supported: this server's models are text-only for now",
    "document": "document content is not supported: this server's models are text-only for now; send the text",
    "search_result": "search_result content is not supported: send the result as text",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        ignored: list[str] = []
        for name in (k for k in data if isinstance(k, str) and k not in cls.model_fields):
            if name in REFUSED_FIELDS and data[name] is not None:
                raise FieldError(REFUSED_FIELDS[name], name)
            ignored.append(name)
        if ignored:
            _log_ignored(cls.__name__, ignored)
        return data


class _Block(BaseModel):
    # cache_control (prompt caching) is accepted: the server's prefix cache reuses any shared prefix anyway
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    """An earlier turn's thinking, sent back by clients; dropped from the prompt as Anthropic drops it."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: StrictStr


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class Tool(_Block):
    # a client tool; Anthropic's server tools (web_search_..., bash_..., ...) carry another ``type``
    type: Literal["custom"] | None = None
    name: StrictStr = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class OutputFormat(BaseModel):
    """Anthropic's structured outputs: the answer is JSON that ``schema`` accepts (the chat's
    ``response_format`` ``json_schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # the chat's reasoning_effort (the same five levels reach the chat template, as on /v1/chat/completions)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> Any:
        if self.type == "tool" and not self.name:
            raise FieldError('tool_choice of type "tool" needs the name of the tool', "tool_choice")
        return self


def _check_blocks(data: Any) -> None:
    """Refuse, naming where, the blocks this server cannot read and the ones in the wrong role's message
    (pydantic's discriminator error would only say the tag is unknown)."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            continue
        for j, block in enumerate(message["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in _REFUSED_BLOCKS:
                raise FieldError(_REFUSED_BLOCKS[kind], where)
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise FieldError(f"content block type {kind!r} is not supported (supported: {', '.join(_BLOCK_TYPES)})",
                                 where)
            role = message.get("role")
            if kind == "tool_use" and role != "assistant":
                raise FieldError("tool_use blocks belong in assistant messages", where)
            if kind == "tool_result" and role != "user":
                raise FieldError("tool_result blocks belong in user messages", where)
    for i, tool in enumerate(data.get("tools") or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise FieldError(f"the server tool {kind!r} is not supported: this server runs the model "
                             "only; define the tool with name, description and input_schema", f"tools[{i}]")


class _Conversation(_Body):
    """What both routes read: the conversation, the tools and how the prompt is rendered."""

    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # the older, beta spelling of output_config.format
    output_format: OutputFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _blocks(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_blocks(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Any:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            # no engine-side thinking budget exists, so budget_tokens could not be kept
            raise FieldError(f"thinking {self.thinking.get('type')!r} is not supported: this server cannot bound "
                             'the thinking by budget_tokens; only {"type": "disabled"} is accepted', "thinking")
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise FieldError("output_format and output_config.format both set: send one", "output_format")
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise FieldError(f"tool_choice {choice.type!r} needs tools", "tool_choice")
        if choice is not None and choice.type == "tool":
            names = [t.name for t in self.tools or []]
            if choice.name not in names:
                raise FieldError(f"tool_choice names the tool {choice.name!r}, which is not in tools {names}",
                                 "tool_choice")
        return self

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema the answer must follow (output_config.format or output_format), if any."""
        fmt = self.output_config.format if self.output_config is not None else None
        fmt = fmt or self.output_format
        return fmt.schema_ if fmt is not None else None

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class MessagesRequest(_Conversation):
    """``POST /v1/messages`` (vLLM's ``AnthropicMessagesRequest``)."""

    max_tokens: StrictInt = Field(ge=1)
    # Anthropic's metadata (user_id) cannot change the output: accepted and logged as ignored
    metadata: dict[str, Any] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _log_metadata(self) -> Any:
        if self.metadata is not None:
            _log_ignored(type(self).__name__, ["metadata"])
        return self


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the prompt ``/v1/messages`` would run, counted."""
