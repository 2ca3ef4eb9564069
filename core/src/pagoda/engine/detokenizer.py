"""Incremental detokenization: decode only a small window of ids per new token.

Decoding the last few tokens with and without the newest one and taking the
difference handles byte-level BPE and SentencePiece spacing without
re-decoding the whole text; text that ends in an incomplete UTF-8 sequence
("\ufffd") is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any

# How many earlier tokens give the decoder its context (spaces, merges).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        ) if ids else ""

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text."""
        delta = ""
        for tok in new_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                piece = full[len(prefix):]
                delta += piece
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                # keep the window short so each step decodes O(1) tokens
                if self.prefix_offset > 64:
                    drop = self.prefix_offset
                    self.ids = self.ids[drop:]
                    self.prefix_offset -= drop
                    self.read_offset -= drop
        self.text += delta
        return delta
