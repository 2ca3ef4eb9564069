"""The engine core in its own process (MPClient) and data parallel replicas (DPLBAsyncMPClient) on a tiny model.

Checks: the same greedy tokens as the in-thread core, aborts reaching the right
replica, both replicas used, and an engine process killed mid-generation turning
into an error for every request in flight, an unhealthy engine and no process left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM, EngineDeadError
from pagoda.engine.core_client import ThreadedClient
from pagoda.engine.mp_client import DPLBAsyncMPClient, MPClient
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [1, 2], [100, 200, 300, 7, 8], [42], [17, 18, 19], [3, 3, 3, 3], [250, 9]]


def _args(path: Any, **kw: Any) -> EngineArgs:
    return EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128, **kw)


def _params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


async def _generate_all(engine: AsyncLLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        outs = [o async for o in engine.generate(prompt, _params(max_tokens), f"r{i}")]
        assert outs and outs[-1].finished
        return list(outs[-1].outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Any) -> list[list[int]]:
    """Greedy tokens of the in-thread core (today's default)."""
    path, _ = tiny_model_dir("llama")
    engine = AsyncLLM.from_engine_args(_args(path))
    try:
        assert isinstance(engine.engine_core, ThreadedClient)
        return asyncio.run(_generate_all(engine, PROMPTS))
    finally:
        engine.shutdown()


def test_engine_core_process_matches_the_thread_aborts_and_refuses_unpicklable(tiny_model_dir: Any, reference: list[list[int]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model_dir("llama")
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", "1")
    engine = AsyncLLM.from_engine_args(_args(path))
    client = engine.engine_core
    try:
        assert isinstance(client, MPClient) and client.proc.pid != os.getpid()
        assert asyncio.run(_generate_all(engine, PROMPTS)) == reference
        asyncio.run(engine.check_health())

        async def abort_midway() -> list[RequestOutput]:
            outs = []
            params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)
            async for o in engine.generate([1, 2, 3], params, "a"):
                outs.append(o)
                if len(outs) == 2:
                    await engine.abort("a")
            return outs

        outs = asyncio.run(abort_midway())
        assert outs[-1].finished and len(outs) < 100  # the abort's own output is the last, with no tokens
        assert engine.num_unfinished_requests() == 0

        def local_processor(token_ids: list[int], logits: Any) -> Any:  # a closure: pickle cannot send it
            return logits

        async def unpicklable() -> None:
            params = SamplingParams(max_tokens=2, logits_processors=[local_processor], detokenize=False)
            with pytest.raises(ValueError, match="must pickle"):
                engine.add_request("x", [1, 2], params)

        asyncio.run(unpicklable())
        assert engine.num_unfinished_requests() == 0
    finally:
        engine.shutdown()
    assert not client.proc.is_alive() and client.proc.exitcode == 0


def test_killed_engine_process_fails_requests_and_health(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model_dir("llama")
    monkeypatch.setenv("PAGODA_ENABLE_V1_MULTIPROCESSING", "1")
    engine = AsyncLLM.from_engine_args(_args(path))
    client = engine.engine_core
    assert isinstance(client, MPClient)

    async def run() -> list[BaseException | list[RequestOutput]]:
        async def one(rid: str) -> list[RequestOutput]:
            outs = []
            params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)
            async for o in engine.generate([1, 2, 3], params, rid):
                outs.append(o)
                if rid == "k0" and len(outs) == 3:
                    os.kill(client.proc.pid, signal.SIGKILL)
            return outs

        return await asyncio.wait_for(asyncio.gather(*(one(f"k{i}") for i in range(4)), return_exceptions=True), 60)

    try:
        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "died" in str(results[0])
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.check_health())

        async def new_request() -> None:
            with pytest.raises(EngineDeadError):
                engine.add_request("late", [1, 2], _params())

        asyncio.run(new_request())
    finally:
        engine.shutdown()
    assert not client.proc.is_alive()
    assert not os.path.exists(client._sockdir)


def test_a_send_to_a_core_that_just_died_raises_instead_of_hanging(tiny_model_dir: Any) -> None:
    """The window between a core's death and the receiver thread noticing it: the command socket has no
    peer, and a plain blocking send there hung the server's event loop for good (seen in CI)."""
    import threading

    from pagoda.engine.config_resolution import prepare_engine_config
    from pagoda.engine.messages import EngineCoreRequest

    path, _ = tiny_model_dir("llama")
    config = _args(path).create_engine_config()
    platform = prepare_engine_config(config)
    client = MPClient(config, platform, on_outputs=lambda _: None, on_dead=lambda _: None)  # no start(): no receiver
    try:
        os.kill(client.proc.pid, signal.SIGKILL)
        client.proc.join(10)
        assert client.dead_error is None  # nobody has noticed yet
        request = EngineCoreRequest("late", [1, 2], _params(), None, time.time())
        raised: list[BaseException] = []

        def send() -> None:
            try:
                for _ in range(2000):  # past any queue the socket could still take
                    client.add_request(request)
            except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
                raised.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "add_request hung on a dead engine core"
        assert len(raised) == 1 and isinstance(raised[0], EngineDeadError), raised
        assert "exit code -9" in str(raised[0])
        client.abort_requests(["late"])  # nothing to abort on a dead core: no error, no hang
    finally:
        client.shutdown()


def test_data_parallel_replicas_match_and_share_the_load(tiny_model_dir: Any, reference: list[list[int]]) -> None:
    path, _ = tiny_model_dir("llama")
    engine = AsyncLLM.from_engine_args(_args(path, data_parallel_size=2))
    client = engine.engine_core
    try:
        assert isinstance(client, DPLBAsyncMPClient) and len(client.engines) == 2
        pids = {e.proc.pid for e in client.engines}
        assert len(pids) == 2 and os.getpid() not in pids
        seen: list[int] = []
        add = client.add_request

        def add_and_record(request: Any) -> None:
            add(request)
            rank = client.replica_of(request.request_id)
            assert rank is not None
            seen.append(rank)

        client.add_request = add_and_record  # type: ignore[method-assign]
        assert asyncio.run(_generate_all(engine, PROMPTS)) == reference
        # eight requests arrive together: fewest in flight alternates between the two replicas
        assert seen.count(0) == seen.count(1) == len(PROMPTS) // 2
        assert client._load == [0, 0] and not client._owner

        async def abort_on_its_replica() -> tuple[int, list[RequestOutput]]:
            long_params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)
            # one long request holds replica 0, so the one to abort lands on replica 1
            holder = engine.add_request("hold", [4, 5], long_params)
            stream = engine.add_request("victim", [1, 2, 3], long_params)
            rank = client.replica_of("victim")
            outs = []
            async for o in stream:
                outs.append(o)
                if len(outs) == 2:
                    await engine.abort("victim")
            holder.abort()
            return rank, outs

        seen.clear()
        rank, outs = asyncio.run(abort_on_its_replica())
        assert seen == [0, 1] and rank == 1
        assert outs[-1].finished and len(outs) < 100  # the abort's own output is the last, with no tokens
        deadline = time.monotonic() + 10
        # the abort went to replica 1 and freed its request there: its gauges come back empty
        while time.monotonic() < deadline and client._stats[1].num_running_reqs:
            time.sleep(0.05)
        assert client._stats[1].num_running_reqs == 0 and client._load == [0, 0]

        async def prefix_routing() -> list[int | None]:
            long_params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)
            shared = list(range(20, 68))  # three full KV blocks of 16
            streams = [engine.add_request("p1", shared + [1], long_params),
                       # one more request than replica 1 holds, but replica 0 has its prefix: it goes there
                       engine.add_request("p2", shared + [2, 3], long_params),
                       # nothing shared: the least loaded replica
                       engine.add_request("q", list(range(100, 148)), long_params)]
            ranks = [client.replica_of(rid) for rid in ("p1", "p2", "q")]
            for stream in streams:
                stream.abort()
            return ranks

        assert asyncio.run(prefix_routing()) == [0, 0, 1]
    finally:
        engine.shutdown()
    assert not any(e.proc.is_alive() for e in client.engines)


def test_llm_engine_refuses_data_parallel(tiny_model_dir: Any) -> None:
    from pagoda.engine.llm_engine import LLMEngine

    path, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        LLMEngine.from_engine_args(_args(path, data_parallel_size=2))


def test_server_answers_503_when_its_engine_process_dies(start_server: Any) -> None:
    """`pagoda serve` with the core in its own process: SIGKILL it mid-stream; the stream ends with an error
    event, /health is 503 and new requests are refused while the server still answers, the server then exits
    by itself (vLLM's rule, so a supervisor restarts it), and no process is left behind."""
    import re

    import httpx

    server = start_server(["--max-model-len", "512"], env={"PAGODA_ENABLE_V1_MULTIPROCESSING": "1"})
    server.log.flush()
    found = re.search(r"engine core 0 runs in process (\d+)", open(server.log.name).read())
    assert found, server.output()
    core_pid = int(found.group(1))
    assert httpx.get(server.url + "/health").status_code == 200
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in head)
        os.kill(core_pid, signal.SIGKILL)
        rest = list(lines)
    errors = [line for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and "engine" in errors[0] and "503" in errors[0], rest[-5:]
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    # the server exits within a watch interval of its engine's death (tests/test_server_hostile.py times
    # it): until then /health is 503 and requests are refused; a refused connection is the exit under way
    try:
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503, late.text
    except httpx.TransportError:
        pass
    server.proc.wait(timeout=60)
    assert server.proc.returncode not in (0, None)
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(core_pid, 0)
