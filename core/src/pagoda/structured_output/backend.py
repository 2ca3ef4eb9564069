"""The interface a structured-output backend plugin implements (group ``pagoda.structured_output_backends``).

A backend compiles a constraint into a grammar once (off the step loop; the
manager caches it by the constraint) and makes a matcher per request. The
bitmask is int32 [rows, ceil(vocab / 32)]: bit ``t % 32`` of word ``t // 32``
set means token ``t`` is allowed (xgrammar's and llguidance's layout).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from pagoda.structured_output.params import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A constraint the backend cannot compile (bad schema, regex or grammar); the message names it."""


class StructuredOutputMatcher(ABC):
    """One request's position in its grammar."""

    # Declares ``rollback``: speculative decoding drafts for a constrained request only with a matcher
    # that can undo tokens (its drafts are walked through the grammar for their bitmask rows, then undone).
    supports_rollback: ClassVar[bool] = False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (only where ``supports_rollback``)."""
        raise NotImplementedError(f"{type(self).__name__} does not support rollback")

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here, the matcher left as it was (vLLM's
        name; speculative drafts are cut there). By default accepted one at a time and rolled back: a
        backend whose matcher cannot take a rejected token and go on overrides it."""
        n = 0
        for token in token_ids:
            if self.is_terminated() or not self.accept_tokens([token]):
                break
            n += 1
        self.rollback(n)
        return n

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and no advance past it) at the first token the grammar rejects."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The constraint is complete and allows nothing more (the request stops)."""


class CompiledGrammar(ABC):
    """A compiled constraint; shared (read-only) by every request with the same constraint."""

    # What the manager's byte-bounded cache counts for a grammar whose backend cannot measure it.
    DEFAULT_SIZE_BYTES = 1 << 20

    @abstractmethod
    def new_matcher(self) -> StructuredOutputMatcher: ...

    def memory_size_bytes(self) -> int:
        """Bytes the grammar holds (the manager's cache is bounded by their sum); override where known."""
        return self.DEFAULT_SIZE_BYTES


class StructuredOutputBackend(ABC):
    """Built once per engine with the engine's tokenizer and the model's vocabulary size."""

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile (slow: may take seconds for a large schema); raises StructuredOutputError on a bad constraint."""

    # -- a compile tried first in a worker process (structured_output/compile_pool.py), where it can be stopped

    def compile_worker_state(self) -> Any | None:
        """Picklable state a worker process builds this backend's compiler from (``worker_compiler``), or None:
        the backend's compiles are not tried out of process (they run in a thread of the engine core only)."""
        return None

    @classmethod
    def worker_compiler(cls, state: Any) -> Any:
        """In the worker: the compiler ``worker_compile`` uses, built once from ``compile_worker_state()``."""
        raise NotImplementedError(f"{cls.__name__} does not compile in a worker process")

    @classmethod
    def worker_compile(cls, compiler: Any, params: StructuredOutputsParams) -> None:
        """In the worker: compile ``params`` as ``compile`` would and drop the result; StructuredOutputError
        on a bad constraint, MemoryError when it cannot allocate."""
        raise NotImplementedError(f"{cls.__name__} does not compile in a worker process")

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Cheap check in the front end, without the tokenizer (the server's 400); raises StructuredOutputError."""

    @staticmethod
    def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Mask ``logits`` [B, V] in place with ``bitmask`` [B, words] (an all-ones row keeps its row).

        Runs in the model runner, which has no backend instance; core's torch version by default, a
        backend may bring its own kernel.
        """
        from pagoda.structured_output.manager import apply_token_bitmask

        apply_token_bitmask(logits, torch.arange(logits.shape[0], device=logits.device), bitmask)

    def fill_bitmasks(self, matchers: Sequence[StructuredOutputMatcher], rows: Sequence[int],
                      bitmask: torch.Tensor) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` (this backend's); a backend may fill them in parallel."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
