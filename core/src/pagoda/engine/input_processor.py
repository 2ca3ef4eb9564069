"""Prompt -> token ids (and, for a multimodal model, its items), with the checks that keep bad input away
from the core."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.engine.prompt_bound import encode_bounded
from pagoda.inputs import parse_prompt
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.multimodal.processing import MultiModalProcessor


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 mm_processor: MultiModalProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # a multimodal model's processor (pagoda.multimodal.processing); None: the model is text-only
        self.mm_processor = mm_processor

    def process(self, prompt: Any, params: SamplingParams | None
                ) -> tuple[str | None, list[int], str | None, MultiModalInputs | None]:
        """-> (text, token ids, cache salt, the multimodal items or None)."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        text, ids, salt = parse_prompt(prompt, allow_mm=mm_data is not None)
        truncate = params.truncate_prompt_tokens if params is not None else None
        mm: MultiModalInputs | None = None
        if mm_data is not None:
            text, ids, mm = self._process_mm(prompt, text, ids, mm_data, truncate)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be given as token ids (prompt_token_ids)")
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
        if mm is None and self.mm_processor is not None and self.mm_processor.image_token_id in ids:
            # the model would read the placeholder's own embedding as if it were an image
            raise ValueError("the prompt has image placeholder tokens but no multi_modal_data: pass the images "
                             "(one per placeholder)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is too long: it must be shorter than the maximum model "
                f"length of {self.max_model_len} tokens to leave room for at least one generated token"
            )
        return text, ids, salt, mm

    def _process_mm(self, prompt: dict[str, Any], text: str | None, ids: list[int] | None, mm_data: Any,
                    truncate: int | None) -> tuple[str, list[int], MultiModalInputs]:
        if self.mm_processor is None:
            raise ValueError("this model is text-only: it takes no multi_modal_data (images); serve a multimodal "
                             "model (docs/multimodal.md)")
        if ids is not None or text is None:
            raise ValueError("multi_modal_data needs a text prompt ('prompt'): its image placeholders are expanded "
                             "by the model's processor")
        if truncate is not None and truncate > 0:
            raise ValueError("truncate_prompt_tokens does not apply to a prompt with multi_modal_data: it would cut "
                             "an image's placeholder tokens")
        ids, mm = self.mm_processor.process(text, mm_data, prompt.get("mm_processor_kwargs"))
        return text, ids, mm
