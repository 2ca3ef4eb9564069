"""Compiles constraints off the step loop and keeps one matcher per constrained request.

Lives beside the scheduler (in the engine core): compiling runs in a thread pool
and is cached by the constraint, the scheduler admits a request once its grammar
is ready, fills one bitmask for the step's sampling rows and advances the
matchers on the accepted tokens.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagoda.plugins import StructuredOutputBackendSpec, get_plugin_manager
from pagoda.structured_output.backend import (
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputMatcher,
)
from pagoda.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pagoda.structured_output_backends"
# Compiling is mostly native code that releases the GIL; a few workers keep a burst of new schemas moving.
_COMPILE_WORKERS = 4


def available_backends() -> dict[str, StructuredOutputBackendSpec]:
    """name -> spec of every backend the loaded plugins register (hook ``pagoda_register_structured_output_backends``)."""
    return get_plugin_manager().structured_output_backends()


@functools.cache
def load_backend_class(name: str) -> type[StructuredOutputBackend]:
    """The backend class by name (cached); 'auto' = the only one installed, or xgrammar when several are."""
    found = available_backends()
    if not found:
        raise StructuredOutputError(
            "structured outputs need a backend plugin (group pagoda.structured_output_backends); "
            "install pagoda-structured-xgrammar"
        )
    if name == "auto":
        name = "xgrammar" if "xgrammar" in found else sorted(found)[0]
    if name not in found:
        raise StructuredOutputError(f"structured outputs backend {name!r} is not installed; installed: {sorted(found)}")
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, StructuredOutputBackend)):
        raise TypeError(f"structured-outputs backend {name!r} ({found[name].cls}) is not a StructuredOutputBackend subclass")
    return cls


class RequestStructuredOutput:
    """A request's constraint: its grammar (compiling, then compiled) and, once ready, its matcher."""

    def __init__(self, params: StructuredOutputsParams, grammar: Future[CompiledGrammar]) -> None:
        self.params = params
        self._grammar = grammar
        self._matcher: StructuredOutputMatcher | None = None

    @property
    def is_ready(self) -> bool:
        return self._grammar.done()

    @property
    def error(self) -> BaseException | None:
        return self._grammar.exception() if self._grammar.done() else None

    @property
    def matcher(self) -> StructuredOutputMatcher:
        if self._matcher is None:
            self._matcher = self._grammar.result().new_matcher()
        return self._matcher


class StructuredOutputManager:
    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int, backend: str = "auto") -> None:
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._backend: StructuredOutputBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[tuple[str, str, bool], Future[CompiledGrammar]] = {}
        self._bitmask: torch.Tensor | None = None

    @property
    def backend(self) -> StructuredOutputBackend:
        # Built on the first constrained request: a server that never sees one never loads the backend.
        if self._backend is None:
            cls = load_backend_class(self.backend_name)
            self._backend = cls(self._tokenizer_factory(), self.vocab_size)
        return self._backend

    def init_request(self, params: StructuredOutputsParams) -> RequestStructuredOutput:
        key = params.cache_key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="pagoda-grammar")
            future = self._pool.submit(self.backend.compile, params)
            self._cache[key] = future
        return RequestStructuredOutput(params, future)

    def grammar_bitmask(self, matchers: list[StructuredOutputMatcher]) -> torch.Tensor:
        """One int32 [len(matchers), words] bitmask: row i = what ``matchers[i]`` allows next."""
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = self.backend.allocate_bitmask(max(len(matchers), 8))
        bitmask = self._bitmask[: len(matchers)]
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[rows[i]]`` keeps only the tokens bit-set in ``bitmask[i]`` (vectorized, no loop over the vocabulary)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1
    disallowed = bits.flatten(1)[:, :vocab] == 0
    if disallowed.shape[1] < vocab:
        # A model's padded vocabulary beyond the bitmask's: never allowed.
        pad = torch.ones(disallowed.shape[0], vocab - disallowed.shape[1], dtype=torch.bool, device=logits.device)
        disallowed = torch.cat((disallowed, pad), dim=1)
    if rows.numel() == logits.shape[0] and bool((rows == torch.arange(rows.numel(), device=rows.device)).all()):
        # every row, in order: in place, without gathering the rows out and back
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
