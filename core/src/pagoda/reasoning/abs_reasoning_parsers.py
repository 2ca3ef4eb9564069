"""The interface a reasoning-parser plugin implements (vLLM's ``vllm.reasoning.ReasoningParser``).

A reasoning model writes its thinking before the answer (``<think>...</think>``).
The parser splits a finished output, or a streamed delta, into
``reasoning_content`` and ``content``; the engine asks it, by token ids, whether
the reasoning has ended, so structured outputs constrain only the answer.
One parser object serves one request (it may keep streaming state).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagoda.plugins import ReasoningParserSpec, get_plugin_manager

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.protocol import DeltaMessage

ENTRY_POINT_GROUP = "pagoda.reasoning_parsers"


class ReasoningParser(ABC):
    """Built with the model's tokenizer; ``kwargs`` carry the request's ``chat_template_kwargs`` when known."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer

    @functools.cached_property
    def vocab(self) -> dict[str, int]:
        # token string -> id, added (special) tokens included
        vocab: dict[str, int] = self.model_tokenizer.get_vocab()
        return vocab

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """The reasoning is over in ``input_ids`` (prompt and output so far): what follows is the answer."""

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        """Reasoning ended in ``delta_ids``, the newest tokens of ``input_ids`` (the engine calls this per step)."""
        return self.is_reasoning_end(input_ids)

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids of the answer (after the reasoning) in ``input_ids``; [] while reasoning."""

    @abstractmethod
    def extract_reasoning_content(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output; either may be None."""

    @abstractmethod
    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What ``delta_text`` adds, split into reasoning and content; None when it adds nothing to show."""

    # vLLM >= 0.11 names
    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        return self.extract_reasoning_content(model_output, request)

    def extract_reasoning_streaming(self, *args: Any) -> DeltaMessage | None:
        return self.extract_reasoning_content_streaming(*args)


class ReasoningParserError(ValueError):
    """An unknown parser name, or a parser the tokenizer cannot serve (its tags are not tokens)."""


def available_reasoning_parsers() -> dict[str, ReasoningParserSpec]:
    """name -> spec of every reasoning parser the loaded plugins register (hook ``pagoda_register_reasoning_parsers``)."""
    return get_plugin_manager().reasoning_parsers()


@functools.cache
def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name`` (vLLM's ``ReasoningParserManager.get_reasoning_parser``)."""
    found = available_reasoning_parsers()
    if name not in found:
        hint = sorted(found) if found else "none installed (pip install pagoda-reasoning-parsers)"
        raise ReasoningParserError(f"reasoning parser {name!r} is not registered; available: {hint}")
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
        raise TypeError(f"reasoning parser {name!r} ({found[name].cls}) is not a pagoda.reasoning.ReasoningParser")
    return cls
