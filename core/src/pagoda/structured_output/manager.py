"""Compiles constraints off the step loop and keeps one matcher per constrained request.

Lives beside the scheduler (in the engine core): compiling runs in a thread pool
(after a worker process proved it ends within the budget, where the backend can:
``compile_pool``) and is cached by the constraint, the scheduler admits a request once its grammar
is ready, fills one bitmask for the step's sampling rows and advances the
matchers on the accepted tokens.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagoda.plugins import StructuredOutputBackendSpec, get_plugin_manager
from pagoda.reasoning import ReasoningParser, get_reasoning_parser
from pagoda.structured_output.auto import AutoBackend
from pagoda.structured_output.backend import (
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputMatcher,
)
from pagoda.structured_output.compile_pool import CompilePool
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
    """The backend class by name (cached); 'auto' = core's AutoBackend, which picks one per request."""
    found = available_backends()
    if not found:
        raise StructuredOutputError(
            "structured outputs need a backend plugin (group pagoda.structured_output_backends); "
            "install pagoda-structured-xgrammar or pagoda-structured-llguidance"
        )
    if name == "auto":
        return AutoBackend
    if name not in found:
        raise StructuredOutputError(f"structured outputs backend {name!r} is not installed; installed: {sorted(found)}")
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, StructuredOutputBackend)):
        raise TypeError(f"structured-outputs backend {name!r} ({found[name].cls}) is not a StructuredOutputBackend subclass")
    return cls


class RequestStructuredOutput:
    """A request's constraint: its grammar (compiling, then compiled) and, once ready, its matcher."""

    def __init__(self, params: StructuredOutputsParams, grammar: Future[CompiledGrammar],
                 backend: StructuredOutputBackend | None = None, reasoning_ended: bool = True,
                 key: tuple[str, str, bool] | None = None, pool_bounded: bool = False) -> None:
        self.params = params
        self._grammar = grammar
        self._matcher: StructuredOutputMatcher | None = None
        # the backend that compiled the grammar (its fill_bitmasks fills this request's row)
        self.backend = backend
        # False while the model is still reasoning (a reasoning parser is set): the grammar waits for the answer
        self.reasoning_ended = reasoning_ended
        # the manager's cache key, and when the request started waiting for the compile (compile_timeout)
        self.key = key
        self.since = time.monotonic()
        # its compile runs under a CompilePool, which enforces compile_timeout on the compile itself
        self.pool_bounded = pool_bounded

    @property
    def is_ready(self) -> bool:
        return self._grammar.done()

    @property
    def error(self) -> BaseException | None:
        if not self._grammar.done() or self._grammar.cancelled():
            return None
        return self._grammar.exception()

    @property
    def matcher(self) -> StructuredOutputMatcher:
        if self._matcher is None:
            self._matcher = self._grammar.result().new_matcher()
        return self._matcher


class _GrammarCache:
    """Compiles by constraint, bounded by bytes: the least recently used grammar no request holds is
    dropped first (200 unique schemas kept ~190 MB for good before). A compile no request waits for any
    more (its clients went away) is cancelled while it is still queued, and killed while it runs where
    its backend compiles in a worker process (``abandon``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._futures: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._users: dict[tuple[str, str, bool], int] = {}
        self._sizes: dict[tuple[str, str, bool], int] = {}
        # how to stop a running compile no request waits for (its pool's abandon), by key
        self._abandon: dict[tuple[str, str, bool], Callable[[Future[CompiledGrammar]], None]] = {}

    def get(self, key: tuple[str, str, bool],
            submit: Callable[[], tuple[Future[CompiledGrammar], Callable[[Future[CompiledGrammar]], None] | None]],
            ) -> Future[CompiledGrammar]:
        future = self._futures.get(key)
        if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
            future, abandon = submit()
            self._futures[key] = future
            self._abandon.pop(key, None)
            if abandon is not None:
                self._abandon[key] = abandon
        self._futures.move_to_end(key)
        self._users[key] = self._users.get(key, 0) + 1
        self._evict()
        return future

    def release(self, key: tuple[str, str, bool]) -> None:
        users = self._users.get(key, 0) - 1
        if users > 0:
            self._users[key] = users
            return
        self._users.pop(key, None)
        future = self._futures.get(key)
        if future is not None and not future.done():
            abandon = self._abandon.pop(key, None)
            if future.cancel():
                del self._futures[key]  # never started: nothing was spent on it
            elif abandon is not None:
                abandon(future)  # killed: a request asking again starts a new compile
                del self._futures[key]
        self._evict()

    @property
    def size_bytes(self) -> int:
        total = 0
        for key, future in self._futures.items():
            total += self._size_of(key, future)
        return total

    def __len__(self) -> int:
        return len(self._futures)

    def _size_of(self, key: tuple[str, str, bool], future: Future[CompiledGrammar]) -> int:
        if key not in self._sizes:
            if not future.done() or future.cancelled() or future.exception() is not None:
                return 0
            self._sizes[key] = future.result().memory_size_bytes()
        return self._sizes[key]

    def _evict(self) -> None:
        total = self.size_bytes
        for key in list(self._futures):
            if total <= self.max_bytes:
                return
            future = self._futures[key]
            if self._users.get(key) or not future.done():
                continue  # held by a request, or still compiling
            total -= self._size_of(key, future)
            del self._futures[key]
            self._sizes.pop(key, None)
            self._abandon.pop(key, None)


class StructuredOutputManager:
    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int, backend: str = "auto",
                 reasoning_parser: str = "", enable_in_reasoning: bool = False,
                 grammar_cache_bytes: int = 256 * 1024 * 1024, compile_timeout: float = 0.0,
                 compile_memory_bytes: int = 0, compile_in_subprocess: bool = True) -> None:
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._backend: StructuredOutputBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        # per backend (by id) that compiles in worker processes; None = it cannot (thread pool instead)
        self._process_pools: dict[int, CompilePool | None] = {}
        self.compile_memory_bytes = compile_memory_bytes
        self.compile_in_subprocess = compile_in_subprocess
        self.cache = _GrammarCache(grammar_cache_bytes)
        # seconds a request may wait for its compile (0 = unbounded): the scheduler fails it after that
        self.compile_timeout = compile_timeout
        self._bitmask: torch.Tensor | None = None
        self.enable_in_reasoning = enable_in_reasoning
        # Built now, not on the first request: a parser this tokenizer cannot serve fails the engine's start.
        self.reasoner: ReasoningParser | None = None
        if reasoning_parser:
            self.reasoner = get_reasoning_parser(reasoning_parser)(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
        return self._tokenizer

    @property
    def backend(self) -> StructuredOutputBackend:
        # Built on the first constrained request: a server that never sees one never loads the backend.
        if self._backend is None:
            cls = load_backend_class(self.backend_name)
            self._backend = cls(self.tokenizer, self.vocab_size)
        return self._backend

    def init_request(self, params: StructuredOutputsParams,
                     prompt_token_ids: list[int] | None = None) -> RequestStructuredOutput:
        backend = self.backend
        if isinstance(backend, AutoBackend):
            backend = backend.backend_for(params)
        key = params.cache_key()
        pool = self._process_pool(backend)

        def submit() -> tuple[Future[CompiledGrammar], Callable[[Future[CompiledGrammar]], None] | None]:
            if pool is not None:
                return pool.submit(params), pool.abandon
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="pagoda-grammar")
            return self._pool.submit(backend.compile, params), None

        future = self.cache.get(key, submit)
        reasoning_ended = True
        if self.reasoner is not None and not self.enable_in_reasoning:
            # a template may have closed the reasoning already (thinking disabled)
            reasoning_ended = self.reasoner.is_reasoning_end(prompt_token_ids or [])
        return RequestStructuredOutput(params, future, backend, reasoning_ended, key, pool_bounded=pool is not None)

    def _process_pool(self, backend: StructuredOutputBackend) -> CompilePool | None:
        if id(backend) not in self._process_pools:
            state = backend.compile_worker_state() if self.compile_in_subprocess else None
            self._process_pools[id(backend)] = None if state is None else CompilePool(
                backend, state, _COMPILE_WORKERS, self.compile_timeout, self.compile_memory_bytes)
        return self._process_pools[id(backend)]

    def release(self, structured: RequestStructuredOutput) -> None:
        """The request is done with its grammar (finished, aborted, failed)."""
        if structured.key is not None:
            self.cache.release(structured.key)
            structured.key = None

    def timed_out(self, structured: RequestStructuredOutput, now: float) -> bool:
        """Still compiling after ``compile_timeout`` seconds (where no CompilePool stops the compile itself)."""
        return (bool(self.compile_timeout) and not structured.pool_bounded and not structured.is_ready
                and now - structured.since > self.compile_timeout)

    def reasoning_ends_with(self, structured: RequestStructuredOutput, all_token_ids: list[int],
                            new_token_ids: list[int]) -> bool:
        """Note whether the tokens just sampled end the reasoning; True if they do (they are not the answer's)."""
        assert self.reasoner is not None
        if self.reasoner.is_reasoning_end_streaming(all_token_ids, new_token_ids):
            structured.reasoning_ended = True
        return structured.reasoning_ended

    def grammar_bitmask(self, requests: list[RequestStructuredOutput]) -> torch.Tensor:
        """One int32 [len(requests), words] bitmask: row i = what ``requests[i]``'s matcher allows next."""
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = StructuredOutputBackend.allocate_bitmask(self.backend, max(len(requests), 8))
        bitmask = self._bitmask[: len(requests)]
        # each backend fills its own rows (one that can fills them in parallel)
        groups: dict[int, tuple[StructuredOutputBackend, list[StructuredOutputMatcher], list[int]]] = {}
        for row, request in enumerate(requests):
            backend = request.backend or self.backend
            group = groups.setdefault(id(backend), (backend, [], []))
            group[1].append(request.matcher)
            group[2].append(row)
        for backend, matchers, rows in groups.values():
            backend.fill_bitmasks(matchers, rows, bitmask)
        return bitmask

    def grammar_bitmask_with_drafts(self, requests: list[RequestStructuredOutput],
                                    drafts: list[list[int]]) -> torch.Tensor:
        """Speculative decoding: ``1 + len(drafts[i])`` consecutive rows for ``requests[i]``: what its matcher
        allows next, then after each of its drafts (walked through the grammar and undone again)."""
        rows = sum(len(d) + 1 for d in drafts)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = StructuredOutputBackend.allocate_bitmask(self.backend, max(rows, 8))
        bitmask = self._bitmask[:rows]
        row = 0
        for request, draft in zip(requests, drafts):
            matcher = request.matcher
            for j in range(len(draft) + 1):
                matcher.fill_bitmask(bitmask, row)
                row += 1
                if j < len(draft) and not matcher.accept_tokens([draft[j]]):
                    raise RuntimeError(f"draft token {draft[j]} was validated but the grammar rejects it")
            matcher.rollback(len(draft))
        return bitmask

    @staticmethod
    def valid_draft_prefix(request: RequestStructuredOutput, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the request's grammar accepts (the matcher is left as it was)."""
        return draft[: request.matcher.validate_tokens(draft)]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for pool in self._process_pools.values():
            if pool is not None:
                pool.shutdown()


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
