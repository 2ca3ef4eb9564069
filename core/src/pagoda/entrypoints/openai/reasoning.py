"""The chat server's side of ``--reasoning-parser``: ``reasoning_content`` split from ``content``, whole or streamed.

The engine holds the same parser for structured outputs (the grammar starts after the reasoning); here one
parser object serves one choice, since a streaming parser may keep state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.reasoning import ReasoningParser, get_reasoning_parser


def reasoning_parser_name(ctx: Any) -> str:
    """The engine's ``--reasoning-parser`` ('' when none)."""
    config = getattr(ctx.engine, "config", None)
    structured = getattr(config, "structured_outputs_config", None)
    return str(getattr(structured, "reasoning_parser", "") or "")


class ChatReasoning:
    """Splits one choice's output; ``prompt_token_ids`` tell whether the chat template opened or closed the
    reasoning."""

    def __init__(self, parser_cls: type[ReasoningParser], tokenizer: Any, request: Any,
                 prompt_token_ids: Sequence[int]) -> None:
        self.request = request
        self.parser = parser_cls(tokenizer, chat_template_kwargs=request.template_kwargs(),
                                 prompt_token_ids=list(prompt_token_ids))
        self.text = ""
        self.token_ids: list[int] = []

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        return self.parser.extract_reasoning_content(text, self.request)

    def delta(self, delta_text: str, delta_token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """(reasoning_content, content) that this step's text adds; either may be None."""
        previous_text, previous_ids = self.text, self.token_ids
        self.text = previous_text + delta_text
        self.token_ids = previous_ids + list(delta_token_ids)
        message = self.parser.extract_reasoning_content_streaming(
            previous_text, self.text, delta_text, previous_ids, self.token_ids, list(delta_token_ids))
        if message is None:
            return None, None
        return message.reasoning_content, message.content


def chat_reasoning(ctx: Any, request: Any, prompt_token_ids: Sequence[int]) -> ChatReasoning | None:
    """A fresh per-choice splitter, or None when the server has no reasoning parser."""
    name = reasoning_parser_name(ctx)
    if not name:
        return None
    return ChatReasoning(get_reasoning_parser(name), ctx.need_tokenizer(), request, prompt_token_ids)


def reasoning_fields(reasoning_content: str | None) -> dict[str, str | None]:
    """The message fields: vLLM's ``reasoning_content`` and its newer name ``reasoning``."""
    return {"reasoning_content": reasoning_content, "reasoning": reasoning_content}
