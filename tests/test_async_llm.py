"""AsyncLLM on a tiny random model: streaming kinds, abort, and a failing step that hurts only its requests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM, EngineGenerateError, RequestOutputCollector
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> Any:
    path, _ = tiny_model_dir("llama")
    eng = AsyncLLM.from_engine_args(EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128))
    yield eng
    eng.shutdown()


def _params(kind: RequestOutputKind, max_tokens: int = 6, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, output_kind=kind, **kw)


async def _collect(engine: AsyncLLM, rid: str, kind: RequestOutputKind, prompt: Any = None) -> list[RequestOutput]:
    return [o async for o in engine.generate(prompt or [5, 6, 7], _params(kind), rid)]


def test_delta_cumulative_and_final_agree(engine: AsyncLLM) -> None:
    async def run() -> tuple[list[RequestOutput], ...]:
        return await asyncio.gather(
            _collect(engine, "d", RequestOutputKind.DELTA),
            _collect(engine, "c", RequestOutputKind.CUMULATIVE),
            _collect(engine, "f", RequestOutputKind.FINAL_ONLY),
        )

    delta, cumulative, final = asyncio.run(run())
    tokens = [t for o in delta for t in o.outputs[0].token_ids]
    assert len(tokens) == 6
    assert cumulative[-1].outputs[0].token_ids == tokens
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == tokens


def test_collector_merges_deltas_for_a_slow_reader() -> None:
    async def run() -> RequestOutput:
        c = RequestOutputCollector(RequestOutputKind.DELTA)
        for i in range(3):
            c.put(RequestOutput("r", None, [1], None, [CompletionOutput(0, f"t{i}", [i], None, None)], finished=i == 2))
        return await c.get()

    out = asyncio.run(run())
    assert out.outputs[0].token_ids == [0, 1, 2] and out.outputs[0].text == "t0t1t2" and out.finished


def test_bad_prompt_raises_before_the_core(engine: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="out of range"):
            engine.add_request("bad", [10**6], _params(RequestOutputKind.DELTA))
        with pytest.raises(ValueError, match="too long"):
            engine.add_request("long", [1] * 200, _params(RequestOutputKind.DELTA))

    asyncio.run(run())
    assert engine.num_unfinished_requests() == 0
    assert not engine.engine_core.core.has_unfinished_requests()


def test_abort_ends_the_stream_and_frees_blocks(engine: AsyncLLM) -> None:
    async def run() -> list[RequestOutput]:
        outs = []
        async for o in engine.generate([1, 2, 3], _params(RequestOutputKind.DELTA, max_tokens=100), "a"):
            outs.append(o)
            if len(outs) == 2:
                await engine.abort("a")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished
    _wait_core_idle(engine)


def _wait_core_idle(engine: AsyncLLM) -> None:
    import time

    deadline = time.monotonic() + 5
    while engine.engine_core.core.has_unfinished_requests() or engine.engine_core.core.kv_cache_manager.usage > 0:
        assert time.monotonic() < deadline, "the core still holds the request"
        time.sleep(0.02)


def test_a_failing_step_fails_only_its_requests(engine: AsyncLLM) -> None:
    runner = engine.engine_core.core.runner
    original = runner.execute_model
    calls = {"n": 0}

    def fail_once(so: Any) -> Any:
        if so.total_num_scheduled_tokens and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("injected device fault")
        return original(so)

    runner.execute_model = fail_once
    try:
        with pytest.raises(EngineGenerateError, match="injected device fault"):
            asyncio.run(_collect(engine, "victim", RequestOutputKind.DELTA))
    finally:
        runner.execute_model = original
    # the loop kept running: the next request is served normally
    outs = asyncio.run(_collect(engine, "after", RequestOutputKind.FINAL_ONLY))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    _wait_core_idle(engine)


def test_many_concurrent_requests(engine: AsyncLLM) -> None:
    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, f"m{i}", RequestOutputKind.DELTA, [1 + i, 2, 3]) for i in range(32)))

    results = asyncio.run(run())
    assert all(sum(len(o.outputs[0].token_ids) for o in outs) == 6 for outs in results)
