"""Which engine-core client AsyncLLM gets: PAGODA_ENABLE_V1_MULTIPROCESSING when set, else the caller's default.

`pagoda serve` asks for the engine core in its own process (as vLLM's server runs it); a script's
AsyncLLM keeps a thread; a tensor/pipeline-parallel engine keeps the thread unless the variable
says 1; data parallel always uses processes. The clients are replaced by recorders: nothing starts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import pagoda.engine.core_client as core_client
import pagoda.engine.mp_client as mp_client


def _config(world_size: int = 1, data_parallel_size: int = 1) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size, data_parallel_size=data_parallel_size))


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> Any:
    def recorder(name: str) -> type:
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})

    monkeypatch.setattr(mp_client, "MPClient", recorder("MPClient"))
    monkeypatch.setattr(mp_client, "DPLBAsyncMPClient", recorder("DPLBAsyncMPClient"))
    monkeypatch.setattr(core_client, "ThreadedClient", recorder("ThreadedClient"))
    monkeypatch.delenv("PAGODA_ENABLE_V1_MULTIPROCESSING", raising=False)

    def choose(config: Any, *engine_core_process: bool) -> str:
        client = mp_client.make_async_client(config, None, lambda outputs: None, lambda exc: None,  # type: ignore[arg-type]
                                             *engine_core_process)
        return type(client).__name__

    return choose


@pytest.mark.parametrize("default, expected", [((), "ThreadedClient"), ((False,), "ThreadedClient"), ((True,), "MPClient")])
def test_unset_variable_takes_the_callers_default(chosen: Any, default: tuple[bool, ...], expected: str) -> None:
    assert chosen(_config(), *default) == expected


@pytest.mark.parametrize("value, expected", [("0", "ThreadedClient"), ("1", "MPClient")])
def test_the_variable_overrides_the_default(chosen: Any, monkeypatch: pytest.MonkeyPatch, value: str, expected: str) -> None:
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", value)
    assert chosen(_config(), True) == expected
    assert chosen(_config()) == expected


def test_multi_rank_engines_keep_the_thread_unless_asked(chosen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen(_config(world_size=2), True) == "ThreadedClient"
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", "1")
    assert chosen(_config(world_size=2), True) == "MPClient"


def test_data_parallel_always_uses_processes(chosen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen(_config(data_parallel_size=2)) == "DPLBAsyncMPClient"
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", "0")
    assert chosen(_config(data_parallel_size=2), False) == "DPLBAsyncMPClient"

