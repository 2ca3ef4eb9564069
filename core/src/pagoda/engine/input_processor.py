"""Prompt -> token ids, with the checks that keep bad input away from the core."""

from __future__ import annotations

from typing import Any

from pagoda.engine.prompt_bound import encode_bounded
from pagoda.inputs import parse_prompt
from pagoda.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(self, prompt: Any, params: SamplingParams | None) -> tuple[str | None, list[int], str | None]:
        text, ids, salt = parse_prompt(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be given as token ids (prompt_token_ids)")
        truncate = params.truncate_prompt_tokens if params is not None else None
        if ids is None:
            if truncate is not None and truncate > 0:
                ids = self.tokenizer(text).input_ids  # the prompt's end is kept: it must be tokenized whole
            else:
                ids = encode_bounded(self.tokenizer, text, self.max_model_len)
        if truncate is not None and truncate > 0 and len(ids) > truncate:
            ids = ids[-truncate:]
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} out of range [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is too long: it must be shorter than the maximum model "
                f"length of {self.max_model_len} tokens to leave room for at least one generated token"
            )
        return text, ids, salt
