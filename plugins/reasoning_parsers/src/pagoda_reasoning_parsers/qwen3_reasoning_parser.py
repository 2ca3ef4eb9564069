"""vLLM's ``qwen3``: reasoning is what ``<think>...</think>`` encloses; an output with neither tag is all answer.

When the chat template opened the reasoning (the prompt ends inside ``<think>``, as Qwen3's templates with
thinking do), the output needs only ``</think>``; when it closed it (``enable_thinking=False`` renders
``<think>\n\n</think>``), the whole output is the answer.
"""

from __future__ import annotations

from typing import Any

from pagoda_reasoning_parsers.basic_parsers import BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    def extract_reasoning_content(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if self.prompt_state == "end":
            return None, model_output
        _, start, rest = model_output.partition(self.start_token)
        opened_by_prompt = self.prompt_state == "start"
        if not start and not opened_by_prompt:
            return None, model_output
        text = rest if start else model_output
        if self.end_token not in text:
            # opened by the template and cut before </think>: reasoning so far; opened in the output but never
            # closed: vLLM's qwen3 needs both tags, so it is all answer
            return (text, None) if opened_by_prompt else (None, model_output)
        reasoning, _, content = text.partition(self.end_token)
        return reasoning, content or None
