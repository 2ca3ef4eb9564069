"""A text prompt's length bounded before the whole text is tokenized.

Tokenizing costs time in proportion to the text (a 10 MB prompt took ~6 s), and the
answer for a prompt far over the context is known from a prefix: the prefix is cut at
``max_model_len * PREFIX_CHARS_PER_TOKEN`` characters, and if that alone holds more
tokens than the context, so does the whole text. A prompt that fits is tokenized once,
whole, as before; only text more compressible than ``PREFIX_CHARS_PER_TOKEN`` characters
per token (long runs of one character) is tokenized in full and checked after.
"""

from __future__ import annotations

from typing import Any

# Above English BPE's ~4 characters per token, so a prompt that fits is never cut.
PREFIX_CHARS_PER_TOKEN = 8
# A cut through the last word can split one token into several (no merge across the cut).
_CUT_SLACK = 8


class PromptTooLongError(ValueError):
    """The prompt holds at least ``at_least`` tokens, more than the context of ``max_model_len``."""

    def __init__(self, at_least: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has at least "
            f"{at_least} tokens; it must be shorter to leave room for at least one generated token.")
        self.at_least = at_least
        self.max_model_len = max_model_len


def encode_bounded(tokenizer: Any, text: str, max_model_len: int, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text).input_ids``; PromptTooLongError, after tokenizing only a prefix, for a text
    whose prefix already overflows the context."""
    cut = max_model_len * PREFIX_CHARS_PER_TOKEN
    if len(text) > cut:
        head = tokenizer(text[:cut], add_special_tokens=add_special_tokens).input_ids
        if len(head) >= max_model_len + _CUT_SLACK:
            raise PromptTooLongError(len(head) - _CUT_SLACK, max_model_len)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
