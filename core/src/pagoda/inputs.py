"""Prompt types accepted by ``LLM.generate`` and the engines (vLLM's names)."""

from __future__ import annotations

from typing import Any, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    # {"image": PIL.Image | [PIL.Image, ...]} for a multimodal model (docs/multimodal.md)
    multi_modal_data: NotRequired[Any]
    # arguments for the model's processor on this prompt (over the engine's mm_processor_kwargs)
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt, list[int]]  # noqa: UP007 (a runtime alias)


def parse_prompt(prompt: Any, allow_mm: bool = False) -> tuple[str | None, list[int] | None, str | None]:
    """-> (text, token ids, cache salt); exactly one of text / ids may be None. ``allow_mm``: the caller
    processes the prompt's ``multi_modal_data`` itself (pagoda.engine.input_processor); elsewhere it is refused."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None and not allow_mm:
            # dropping it would answer about a prompt the user did not send
            raise ValueError("multi_modal_data is supported by generate and chat only (not by pooling or beam search)")
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids), salt
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("'prompt' must be a string")
            return prompt["prompt"], None, salt
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt), None
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}: expected str, TextPrompt or TokensPrompt")
