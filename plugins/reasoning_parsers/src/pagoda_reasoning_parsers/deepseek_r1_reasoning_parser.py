"""vLLM's ``deepseek_r1``: everything before ``</think>`` is reasoning, whether or not ``<think>`` was written
(the R1 chat template opens it in the prompt, and the model often omits it)."""

from __future__ import annotations

from typing import Any

from pagoda_reasoning_parsers.basic_parsers import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    implicit_start = True

    def extract_reasoning_content(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        _, start, rest = model_output.partition(self.start_token)
        text = rest if start else model_output
        if self.end_token not in text:
            # no end yet (or cut by max_tokens): all of it is reasoning
            return text, None
        reasoning, _, content = text.partition(self.end_token)
        return reasoning, content or None
