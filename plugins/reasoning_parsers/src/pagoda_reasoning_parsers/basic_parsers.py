"""Reasoning between a start and an end tag that are single tokens (``<think>`` / ``</think>``).

The request's prompt decides where the output starts: a chat template may open
the reasoning (its prompt ends inside ``<think>``) or close it (``<think></think>``
when thinking is disabled). The parser reads that from ``prompt_token_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagoda.entrypoints.openai.protocol import DeltaMessage
from pagoda.reasoning import ReasoningParser, ReasoningParserError


class BaseThinkingReasoningParser(ReasoningParser):
    start_token: str = "<think>"
    end_token: str = "</think>"
    # The output is reasoning until the end tag even when it never wrote the start tag (DeepSeek-R1).
    implicit_start: bool = False

    def __init__(self, tokenizer: Any, *args: Any, prompt_token_ids: Sequence[int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        start_id = self.vocab.get(self.start_token)
        end_id = self.vocab.get(self.end_token)
        if start_id is None or end_id is None:
            raise ReasoningParserError(
                f"{type(self).__name__} needs {self.start_token!r} and {self.end_token!r} as single tokens; "
                "this model's tokenizer has no such tokens (is it a reasoning model?)")
        self.start_token_id: int = start_id
        self.end_token_id: int = end_id
        # the last tag in the prompt: "start" (the template opened the reasoning), "end" (it closed it) or None
        self.prompt_state = self._last_tag(prompt_token_ids or [])

    def _last_tag(self, ids: Sequence[int]) -> str | None:
        for token in reversed(ids):
            if token == self.start_token_id:
                return "start"
            if token == self.end_token_id:
                return "end"
        return None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return self._last_tag(input_ids) == "end"

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        return self.end_token_id in set(delta_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        # the end tag as the last token leaves no content yet
        if self.end_token_id not in input_ids[:-1]:
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1:]

    def _started(self, previous_token_ids: Sequence[int]) -> bool:
        return self.implicit_start or self.prompt_state == "start" or self.start_token_id in previous_token_ids

    def _split(self, text: str, token_ids: Sequence[int], tag: str, tag_id: int) -> tuple[str, str]:
        """``text`` before and after ``tag``; by token ids when the detokenizer dropped the tag (a special token)."""
        before, found, after = text.partition(tag)
        if found:
            return before, after
        k = list(token_ids).index(tag_id)
        decode = self.model_tokenizer.decode
        return decode(list(token_ids[:k])), decode(list(token_ids[k + 1:]))

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if self.prompt_state == "end" and not self.implicit_start:
            return DeltaMessage(content=delta_text) if delta_text else None
        started = self._started(previous_token_ids)
        if started and self.end_token_id in previous_token_ids:
            return DeltaMessage(content=delta_text) if delta_text else None
        if started or self.start_token_id in delta_token_ids:
            text, ids = delta_text, list(delta_token_ids)
            if self.start_token_id in ids:
                _, text = self._split(text, ids, self.start_token, self.start_token_id)
                ids = ids[ids.index(self.start_token_id) + 1:]
            if self.end_token_id in ids:
                reasoning, content = self._split(text, ids, self.end_token, self.end_token_id)
                if not reasoning and not content:
                    return None
                return DeltaMessage(reasoning_content=reasoning or None, content=content or None)
            return DeltaMessage(reasoning_content=text) if text else None
        return DeltaMessage(content=delta_text) if delta_text else None
