"""Request bodies of the OpenAI-compatible API, with vLLM's extra sampling parameters.

Unknown fields are accepted as vLLM accepts them (clients such as LangChain and
LiteLLM send OpenAI's newer fields: ``metadata``, ``store``, ``service_tier``, ...)
and each name is logged once as ignored; OpenAI's fields that would change the
output in a way pagoda cannot (``audio``, ``web_search_options``, ...)
are refused by name. Every bound pydantic can check is declared here so the
error names the field.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

logger = logging.getLogger(__name__)


class FieldError(ValueError):
    """A check across fields that still blames one: the error body's ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# OpenAI's fields that ask for something this server cannot do: a set (non-null) value is refused by name,
# since ignoring it would answer a different question than the one asked.
REFUSED_FIELDS: dict[str, str] = {
    "audio": "audio output is not supported: this server generates text only",
    "web_search_options": "web search is not supported: this server runs the model only, with no search tool",
    # vLLM's older per-request backend choice (gone from vLLM since the backend became an engine setting)
    "guided_decoding_backend": "guided_decoding_backend is not a request field here: the structured-outputs backend "
                               "is the server's (--structured-outputs-config '{\"backend\": ...}')",
    "verbosity": "verbosity is not supported: no model served here takes a verbosity setting; ask for length "
                 "in the prompt or bound it with max_tokens",
}

_logged_ignored: set[str] = set()
_logged_lock = threading.Lock()


def _log_ignored(body: str, names: list[str]) -> None:
    """Name each ignored field once per process: a client that always sends one must not flood the log."""
    with _logged_lock:
        new = [n for n in names if f"{body}.{n}" not in _logged_ignored]
        _logged_ignored.update(f"{body}.{n}" for n in new)
    if new:
        logger.warning("%s: request fields ignored (unknown here, or unable to change the output): %s; "
                       "each is named once", body, ", ".join(sorted(new)))


def _modalities_error(value: Any) -> str | None:
    if value is None or value == ["text"]:
        return None
    return f"modalities {value!r} is not supported: this server generates text only (modalities: [\"text\"])"


# OpenAI's bound on a logit_bias value.
MAX_LOGIT_BIAS = 100.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        """vLLM's reading of fields outside the body: accepted and logged as ignored; those of
        ``REFUSED_FIELDS`` (and non-text ``modalities``) refused by name when set."""
        if not isinstance(data, dict):
            return data
        unknown = [k for k in data if isinstance(k, str) and k not in cls.model_fields]
        ignored: list[str] = []
        for name in unknown:
            value = data[name]
            reason = _modalities_error(value) if name == "modalities" else \
                (REFUSED_FIELDS.get(name) if value is not None else None)
            if reason is not None:
                raise FieldError(reason, name)
            ignored.append(name)
        if ignored:
            _log_ignored(cls.__name__, ignored)
        return data


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class PredictionTextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class PredictionContent(BaseModel):
    """OpenAI's predicted output: the text the answer is expected to be (mostly); its tokens are drafted and
    verified by speculative decoding, so the output is the model's own either way."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: StrictStr | list[PredictionTextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extras)."""

    model: StrictStr | None = None
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: StrictInt = Field(1, ge=1)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: StrictStr | None = None
    # vLLM's extra sampling parameters
    best_of: StrictInt | None = Field(None, ge=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    length_penalty: float = 1.0
    stop_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    allowed_token_ids: list[StrictInt] | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0)
    priority: StrictInt = 0
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = None
    # OpenAI's predicted outputs (pagoda.spec_decode.prediction)
    prediction: PredictionContent | None = None
    # structured outputs: vLLM's extra body (StructuredOutputsParams' fields) and its older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @model_validator(mode="after")
    def _logit_bias_in_range(self) -> Any:
        # OpenAI refuses a bias outside [-100, 100]; clamping it would answer a request the client did not send
        for token, bias in (self.logit_bias or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise FieldError(f"logit_bias[{token!r}] = {bias} is outside [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}]", "logit_bias")
        return self

    @model_validator(mode="after")
    def _length_penalty_needs_beam_search(self) -> Any:
        # vLLM applies it only in beam search, which these endpoints do not offer: accepting it would ignore it
        if self.length_penalty != 1.0:
            raise FieldError("length_penalty only applies to beam search, which this endpoint does not run "
                             "(use LLM.beam_search offline)", "length_penalty")
        return self


PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0)
    max_tokens: StrictInt | None = Field(16, ge=1)
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True
    response_format: dict[str, Any] | None = None
    return_tokens_as_token_ids: StrictBool = False


class TextContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Body):
    url: StrictStr
    # OpenAI's resolution hint; the model's processor decides the resolution, so only "auto" is accepted
    detail: Literal["auto"] | None = None


class ImageURLContentPart(_Body):
    """An image for a multimodal model: a data: URL, or http(s):// / file:// where the server allows them."""

    type: Literal["image_url"]
    image_url: ImageURL


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


# vLLM's name for the function half of a tool call
FunctionCall = ToolCallFunction


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a function call: the name once, then argument fragments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of ``tool_calls[index]``; ``id`` and ``type`` come with its first piece."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What one streamed chunk adds to a chat message (vLLM's ``DeltaMessage``)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ExtractedToolCallInformation(BaseModel):
    """A tool parser's reading of a whole output: the calls found and the text left as ``content``."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_part_types(cls, data: Any) -> Any:
        # named here: the union's own error would only say the content is not a string
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(f"content[{i}] has type {kind!r}: the supported content parts are 'text' and "
                                     "'image_url'")
                detail = part.get("image_url", {}).get("detail") if kind == "image_url" and isinstance(
                    part.get("image_url"), dict) else None
                if detail not in (None, "auto"):
                    raise ValueError(f"content[{i}].image_url.detail={detail!r} is not supported: the model's "
                                     "processor decides the image resolution (only 'auto')")
        return data

    @model_validator(mode="after")
    def _content_present(self) -> Any:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extras
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    return_tokens_as_token_ids: StrictBool = False
    # OpenAI's reasoning models' knob; as vLLM, it reaches the chat template (templates that read it, such as
    # gpt-oss's and Qwen's, change the prompt) together with enable_thinking
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` (and the ``enable_thinking`` it implies) under them:
        the request's own ``chat_template_kwargs`` win, as in vLLM."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none",
                **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _consistent(self) -> Any:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        if self.stream and self.prompt_logprobs:
            raise FieldError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_choice_matches_tools(self) -> Any:
        """vLLM's checks: a tool_choice other than "none" needs tools, and a named one must be among them."""
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise FieldError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                 "'parameters': ...}}}}", f"tools[{i}]")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise FieldError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                             "tool_choice")
        if self.tools is None:
            raise FieldError("tool_choice other than 'none' needs tools: When using `tool_choice`, `tools` must be set",
                             "tools")
        if choice == "required" and not self.tools:
            # OpenAI's and vLLM's reading: nothing is required of an empty tool list
            self.tool_choice = "none"
            return self
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
                raise FieldError('a named tool_choice is {"type": "function", "function": {"name": "my_function"}}',
                                 "tool_choice")
            names = [t["function"]["name"] for t in self.tools]
            if name not in names:
                raise FieldError(f"tool_choice names the function {name!r}, which is not in tools {names}",
                                 "tool_choice")
        return self


class TokenizeCompletionRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's body; PAGODA_ALLOW_RUNTIME_LORA_UPDATING)."""

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and not needed: names are unique)."""

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


class ModelActionRequest(_Body):
    """``POST /v1/models/load`` and ``/v1/models/unload`` of a many-model server (pagoda's; no vLLM equivalent)."""

    model: StrictStr
