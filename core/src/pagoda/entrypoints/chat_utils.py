"""Chat messages -> prompt text through the tokenizer's (or a given) Jinja chat template.

Shared by ``LLM.chat`` and the server. Message content is a string or a list of
``{"type": "text", "text": ...}`` parts, joined with newlines (vLLM's "string"
content format); other part types are refused with the type named. For a
multimodal model, ``extract_images`` first takes the image parts (``image_url``,
``image_pil``) out: the message keeps its parts as a list, each image a
``{"type": "image"}`` placeholder that the model's template writes as its image
token (vLLM's "openai" content format), and the images go to the prompt's
``multi_modal_data`` in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Arguments render_chat_prompt passes itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "tools", "documents", "return_dict",
    "add_generation_prompt", "continue_final_message", "tokenizer_kwargs",
})


def content_to_text(content: Any, where: str = "content") -> str | None:
    """A message's content as plain text: a string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{i}] must be a {{'type': 'text', 'text': ...}} part, got {type(part).__name__}")
        kind = part.get("type", "text")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}] has type {kind!r}: only text parts with a string 'text' are supported")
        texts.append(part["text"])
    return "\n".join(texts)


# content part types that carry an image (vLLM's names)
IMAGE_PART_TYPES = ("image_url", "image_pil")


def extract_images(messages: Sequence[Any], load_image: Callable[[Any], Any] | None
                   ) -> tuple[list[Any], list[Any]]:
    """-> (the messages with each image part replaced by ``{"type": "image"}``, the images in order).

    ``load_image`` turns an ``image_url`` part's URL into an image (the media policy decides what it reads);
    None: the model is text-only, and a conversation with an image part is refused before anything is read.
    """
    from PIL import Image

    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return list(messages) if isinstance(messages, Sequence) else messages, []
    out: list[Any] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if (isinstance(content, str) or not isinstance(content, Sequence)
                or not any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES for p in content)):
            out.append(message)
            continue
        if load_image is None:
            raise ValueError(f"messages[{i}].content has an image part, but this model is text-only: it takes no "
                             "images (serve a multimodal model, docs/multimodal.md)")
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(load_image(url.get("url") if isinstance(url, Mapping) else url))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                image = part.get("image_pil")
                if not isinstance(image, Image.Image):
                    raise ValueError(f"messages[{i}].content[{j}].image_pil must be a PIL.Image.Image")
                images.append(image)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _template_content(content: Any, where: str) -> Any:
    """A message's content for the template: text, or (with images) its parts as text / image dicts."""
    if isinstance(content, Sequence) and not isinstance(content, str) and any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in content):
        return [{"type": "image"} if isinstance(p, Mapping) and p.get("type") == "image"
                else {"type": "text", "text": content_to_text([p], f"{where}[{j}]")} for j, p in enumerate(content)]
    return content_to_text(content, where) or ""


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts with string content, as vLLM hands them to templates.

    Missing or null content becomes "" (an assistant message that only calls tools has
    none, and templates concatenate it); tool-call ``arguments`` sent as a JSON string
    are parsed into an object (transformers' convention for tool-use templates).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        d = dict(message)
        d["content"] = _template_content(message.get("content"), f"messages[{i}].content")
        if d.get("tool_calls") is not None:
            d["tool_calls"] = _tool_calls_for_template(d["tool_calls"], f"messages[{i}].tool_calls")
        out.append(d)
    return out


def _tool_calls_for_template(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, bytes)):
        raise ValueError(f"{where} must be a list of tool calls")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ValueError(f"{where}[{j}] must be a {{'type': 'function', 'function': {{'name', 'arguments'}}}} dict")
        function = dict(call["function"])
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}[{j}].function.arguments is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError(f"{where}[{j}].function.arguments is nested too deeply") from None
        out.append({**call, "function": function})
    return out


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Any],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The prompt text for one conversation (``tokenizer.apply_chat_template(..., tokenize=False)``).

    Tokenize the result with ``add_special_tokens=False``: the template already
    writes any BOS it wants.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, but the engine runs with skip_tokenizer_init=True")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass chat_template (a Jinja template string)")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: use the arguments of the same name")
    conversation = normalize_messages(messages)
    if continue_final_message and (not conversation or conversation[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message to continue")
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **kwargs,
    )
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def is_conversation_list(messages: Any) -> bool:
    """True for a list of conversations (a list of lists of messages), False for one conversation."""
    return isinstance(messages, Sequence) and bool(messages) and all(
        isinstance(m, Sequence) and not isinstance(m, (str, bytes, Mapping)) for m in messages
    )
