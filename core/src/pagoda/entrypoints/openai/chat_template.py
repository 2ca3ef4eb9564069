"""Chat messages -> prompt text through the tokenizer's (or a given) Jinja chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.entrypoints.chat_utils import render_chat_prompt
from pagoda.entrypoints.deadline import DeadlineExceeded, call_with_deadline
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatMessage, ImageURLContentPart, TextContentPart


def load_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template itself (as vLLM)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the chat template file {value!r}: {exc}") from exc
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")
    return value


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Text parts are joined with newlines (vLLM's "string" content format); content with image parts stays
    a list of part dicts (``pagoda.entrypoints.chat_utils.extract_images`` takes the images out)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content: Any = m.content
        if isinstance(content, list):
            if any(isinstance(p, ImageURLContentPart) for p in content):
                content = [p.model_dump(exclude_none=True) for p in content]
            else:
                content = "\n".join(p.text for p in content if isinstance(p, TextContentPart))
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        out.append(d)
    return out


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage] | list[dict[str, Any]],
    *,
    request_template: str | None,
    server_template: str | None,
    template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    trust_request_template: bool = False,
    timeout: float | None = None,
) -> str:
    """``render_chat_prompt`` (shared with ``LLM.chat``) with its errors as 400s naming the field.

    A request's own template is refused unless ``trust_request_template`` (vLLM's
    ``--trust-request-chat-template``); any template is stopped after ``timeout`` seconds.
    """
    if request_template is not None and not trust_request_template:
        raise APIError("Chat template is passed with request, but --trust-request-chat-template is not set: a "
                       "request's own chat_template is refused (it is arbitrary Jinja run on the server)", 400,
                       "chat_template")
    if tokenizer is None:
        raise APIError("the server runs without a tokenizer (skip_tokenizer_init): chat is unavailable", 400, "messages")
    template = request_template or server_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("the model has no chat template: pass chat_template in the request or start the server with "
                       "--chat-template", 400, "chat_template")
    kwargs = dict(template_kwargs or {})
    param = "chat_template" if request_template else ("chat_template_kwargs" if kwargs else "messages")
    try:
        return call_with_deadline(lambda: render_chat_prompt(
            tokenizer,
            messages if all(isinstance(m, dict) for m in messages) else message_dicts(messages),  # type: ignore[arg-type]
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=kwargs,
            documents=documents,
        ), timeout)
    except DeadlineExceeded:
        raise APIError(f"the chat template took longer than the server's limit of {timeout:g} s to render "
                       "(--chat-template-render-timeout)", 400, param) from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault, not the server's
        message = str(exc)
        if "chat_template_kwargs may not set" in message:
            raise APIError(message, 400, "chat_template_kwargs") from None
        raise APIError(f"the chat template could not be applied: {type(exc).__name__}: {exc}", 400, param) from None
