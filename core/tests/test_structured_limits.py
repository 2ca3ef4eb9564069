"""The front end's bounds on a constraint's size, and the byte-bounded grammar cache (issue 39)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from pagoda.config import StructuredOutputsConfig
from pagoda.structured_output.backend import CompiledGrammar, StructuredOutputError, StructuredOutputMatcher
from pagoda.structured_output.limits import check_constraint_size
from pagoda.structured_output.manager import _GrammarCache
from pagoda.structured_output.params import StructuredOutputsParams


def _props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


LIMITS = StructuredOutputsConfig()


def test_schema_properties_nodes_and_characters_are_bounded() -> None:
    check_constraint_size(StructuredOutputsParams(json=_props(400)), LIMITS)
    with pytest.raises(StructuredOutputError, match="401 properties.*max_schema_properties"):
        check_constraint_size(StructuredOutputsParams(json=_props(401)), LIMITS)
    # nested objects and the schema given as text are counted the same way
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": _props(10_000)}}}
    with pytest.raises(StructuredOutputError, match="max_schema_properties"):
        check_constraint_size(StructuredOutputsParams(json=nested), LIMITS)
    import json

    with pytest.raises(StructuredOutputError, match="max_schema_properties"):
        check_constraint_size(StructuredOutputsParams(json=json.dumps(_props(1000))), LIMITS)
    wide = {"type": "object", "properties": {f"o{i}": _props(300) for i in range(40)}}
    with pytest.raises(StructuredOutputError, match="max_schema_nodes"):
        check_constraint_size(StructuredOutputsParams(json=wide), LIMITS)
    with pytest.raises(StructuredOutputError, match="max_constraint_chars"):
        check_constraint_size(StructuredOutputsParams(regex="a" * 100_001), LIMITS)
    with pytest.raises(StructuredOutputError, match="max_constraint_chars"):
        check_constraint_size(StructuredOutputsParams(choice=["x" * 60_000, "y" * 60_000]), LIMITS)
    # 0 turns a bound off
    check_constraint_size(StructuredOutputsParams(json=_props(5000)),
                          StructuredOutputsConfig(max_schema_properties=0, max_schema_nodes=0))


class _Grammar(CompiledGrammar):
    def __init__(self, size: int) -> None:
        self.size = size

    def new_matcher(self) -> StructuredOutputMatcher:
        raise NotImplementedError

    def memory_size_bytes(self) -> int:
        return self.size


def _done(size: int) -> tuple[Future[CompiledGrammar], None]:
    """A compile already finished, as a cache's ``submit`` returns it (no worker to abandon)."""
    f: Future[CompiledGrammar] = Future()
    f.set_result(_Grammar(size))
    return f, None


def test_the_cache_is_lru_by_bytes_and_keeps_what_requests_hold() -> None:
    cache = _GrammarCache(max_bytes=3000)
    keys = [("json", str(i), False) for i in range(10)]
    for key in keys:
        cache.get(key, lambda: _done(1000))
        cache.release(key)
    assert len(cache) == 3 and cache.size_bytes == 3000
    # the three newest stay; a hit refreshes its place
    assert cache.get(keys[7], lambda: pytest.fail("a cached grammar was compiled again")).result().size == 1000
    cache.get(keys[0], lambda: _done(1000))  # evicts 8, the least recently used
    cache.get(keys[1], lambda: _done(1000))  # evicts 9
    cache.get(keys[2], lambda: _done(1000))  # 7, 0, 1, 2 are all held by requests: none can go
    assert cache.size_bytes == 4000
    cache.get(keys[8], lambda: _done(1000))  # compiled again: it had gone
    cache.release(keys[8])
    assert cache.size_bytes == 4000  # and dropped at once, over budget and unheld
    cache.release(keys[7])  # the oldest held one is let go: the cache is back in budget
    assert cache.size_bytes == 3000
    for key in keys[:3]:
        cache.release(key)
    assert cache.size_bytes == 3000


def test_a_queued_compile_nobody_waits_for_is_cancelled() -> None:
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    cache = _GrammarCache(max_bytes=1 << 30)
    try:
        busy = ("json", "busy", False)
        queued = ("json", "queued", False)
        running = cache.get(busy, lambda: (pool.submit(lambda: (gate.wait(10), _Grammar(1))[1]), None))
        waiting = cache.get(queued, lambda: (pool.submit(lambda: _Grammar(1)), None))
        cache.release(queued)  # its client went away before the compile started
        assert waiting.cancelled() and len(cache) == 1
        # asked again: compiled anew rather than answered with the cancelled future
        again = cache.get(queued, lambda: (pool.submit(lambda: _Grammar(2)), None))
        assert again is not waiting
        gate.set()
        assert running.result(10).memory_size_bytes() == 1
        assert again.result(10).memory_size_bytes() == 2
    finally:
        gate.set()
        pool.shutdown()
