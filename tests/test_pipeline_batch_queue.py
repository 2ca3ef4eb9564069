"""Pipeline parallelism with several micro-batches in flight (the engine's batch queue), mp executor.

More concurrent requests than one batch takes, greedy tokens equal transformers' (float32) for a tiny
Llama (with a KV cache small enough that requests are preempted while their batch runs) and a tiny
Qwen3; the two stages' step times overlap with two batches in flight and never with one;
a request aborted while its batch runs, and its id reused at once. The Ray twin is in
tests/test_ray_executor.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagoda import LLM, SamplingParams

NEW_TOKENS = 8


def _prompts(vocab: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _llm(path: Any, **kwargs: Any) -> LLM:
    args: dict[str, Any] = dict(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                                block_size=16, max_num_batched_tokens=64, enable_prefix_caching=True,
                                pipeline_parallel_size=2, distributed_executor_backend="mp")
    args.update(kwargs)
    return LLM(**args)


def _check_greedy(llm: LLM, hf_model: Any, prompts: list[list[int]], hf_greedy: Any, divergence_is_a_tie: Any,
                  new_tokens: int = NEW_TOKENS) -> None:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        expected = hf_greedy(hf_model, p, new_tokens)
        got = list(o.outputs[0].token_ids)
        assert got == expected or divergence_is_a_tie(hf_model, p, got, expected), (p, got, expected)


def stage_overlaps(executor: Any) -> tuple[int, int]:
    """(steps, how many times stage 1 started step k + 1 before stage 2 finished step k) since the last call.

    Both ranks run every step, in the same order; their times are CLOCK_MONOTONIC, one clock for the
    machine. With one batch in flight stage 1 cannot start k + 1 before the engine has k's tokens.
    """
    first, last = executor.collective_rpc("get_step_times")[:2]
    assert len(first) == len(last)
    return len(first), sum(1 for k in range(len(first) - 1) if first[k + 1][0] < last[k][1])


@pytest.fixture(scope="module")
def llama_pp2(tiny_model_dir: Any) -> Any:
    path, hf_model = tiny_model_dir("llama")
    # 12 blocks of 16 tokens for 16 requests of up to 64 tokens: requests that outgrow their blocks preempt
    # others, some while their batch runs
    llm = _llm(path, num_kv_blocks=12)
    yield llm, hf_model
    llm.llm_engine.engine_core.shutdown()


def test_llama_pp2_greedy_equals_transformers_with_preemption_in_flight(
        llama_pp2: Any, hf_greedy: Any, divergence_is_a_tie: Any) -> None:
    llm, hf_model = llama_pp2
    core = llm.llm_engine.engine_core.core
    assert core.batch_queue_size == 2 == core.model_executor.max_concurrent_batches
    scheduler = core.scheduler
    preempted_in_flight: list[str] = []
    preempt = scheduler._preempt

    def watch(victim: Any) -> None:  # records, then preempts as always
        if victim.request_id in scheduler.in_flight_request_ids():
            preempted_in_flight.append(victim.request_id)
        preempt(victim)

    scheduler._preempt = watch  # type: ignore[method-assign]
    try:
        _check_greedy(llm, hf_model, _prompts(hf_model.config.vocab_size), hf_greedy, divergence_is_a_tie,
                      new_tokens=24)
    finally:
        del scheduler._preempt
    assert preempted_in_flight, "the KV cache was meant to force preemptions of requests in flight"
    assert not core.batch_queue and not core.scheduler.in_flight_request_ids()


def test_stages_overlap_with_two_batches_in_flight_and_not_with_one(
        llama_pp2: Any, hf_greedy: Any, divergence_is_a_tie: Any) -> None:
    llm, hf_model = llama_pp2
    core = llm.llm_engine.engine_core.core
    executor = core.model_executor
    prompts = _prompts(hf_model.config.vocab_size, n=8, seed=1)
    try:
        for size in (1, 2):
            core.batch_queue_size = size
            stage_overlaps(executor)  # forget earlier steps
            _check_greedy(llm, hf_model, prompts, hf_greedy, divergence_is_a_tie)
            steps, overlaps = stage_overlaps(executor)
            if size == 1:
                assert steps > NEW_TOKENS and overlaps == 0
            else:
                # every decode step after the first pair overlaps in principle; the loaded machine may
                # let a stage finish before the other starts now and then
                assert steps > NEW_TOKENS and overlaps >= steps // 3, (steps, overlaps)
    finally:
        core.batch_queue_size = 2
    with pytest.raises(ValueError, match="batch_queue_size must be 1..2"):
        core.batch_queue_size = 3


def test_abort_in_flight_and_the_id_reused_at_once(llama_pp2: Any, hf_greedy: Any) -> None:
    llm, hf_model = llama_pp2
    engine = llm.llm_engine
    core = engine.engine_core.core
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": p for i, p in enumerate(_prompts(hf_model.config.vocab_size, n=4, seed=2))}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    finished: dict[str, list[int]] = {}
    victim = None
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if core.batch_queue and any(core.scheduler.requests[r].num_output_tokens >= 2
                                    for r in core.batch_queue[0][1].num_scheduled_tokens if r in core.scheduler.requests):
            victim = next(iter(core.batch_queue[0][1].num_scheduled_tokens))
            break
    assert victim is not None, "no batch was in flight between steps"
    assert victim in core.scheduler.in_flight_request_ids()
    engine.abort_request(victim)
    reused = [7, 8, 9, 10, 11]
    engine.add_request(victim, {"prompt_token_ids": reused}, params)  # while the old batch still runs
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    for rid, p in prompts.items():
        if rid != victim:
            assert finished[rid] == hf_greedy(hf_model, p, NEW_TOKENS), rid
    assert finished[victim] == hf_greedy(hf_model, reused, NEW_TOKENS)
    assert not core.batch_queue and not core.scheduler.requests and not core.scheduler.in_flight_request_ids()


def test_qwen3_pp2_greedy_equals_transformers(tiny_model_dir: Any, hf_greedy: Any,
                                                           divergence_is_a_tie: Any) -> None:
    path, hf_model = tiny_model_dir("qwen3")
    llm = _llm(path, num_kv_blocks=128)
    executor = llm.llm_engine.engine_core.core.model_executor
    try:
        stage_overlaps(executor)
        _check_greedy(llm, hf_model, _prompts(hf_model.config.vocab_size, seed=3), hf_greedy, divergence_is_a_tie)
        steps, overlaps = stage_overlaps(executor)
        assert overlaps > 0, (steps, overlaps)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_stage_killed_with_two_batches_in_flight_fails_every_request(tiny_model_dir: Any) -> None:
    import os
    import signal
    import threading
    import time

    from pagoda.config import EngineArgs
    from pagoda.engine.core import prepare_engine_config
    from pagoda.engine.core_client import ThreadedClient
    from pagoda.engine.messages import EngineCoreOutputs
    from pagoda.executor import ExecutorFailedError
    from pagoda.engine.messages import EngineCoreRequest

    path, _ = tiny_model_dir("llama")
    config = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                        num_kv_blocks=64, pipeline_parallel_size=2,
                        distributed_executor_backend="mp").create_engine_config()
    platform = prepare_engine_config(config)
    batches: list[EngineCoreOutputs] = []
    dead = threading.Event()
    client = ThreadedClient(config, platform, batches.append, lambda exc: dead.set())
    pids = [p.pid for p in client.core.model_executor.workers]
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(6):
            client.add_request(EngineCoreRequest(f"r{i}", [1 + i, 2, 3], params, None, 0.0))
        client.start()
        deadline = time.monotonic() + 60
        while sum(len(b.outputs) for b in batches) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(b.outputs) for b in batches) >= 12, "no tokens before the kill"
        os.kill(pids[0], signal.SIGKILL)  # the first stage: the last one may be mid-batch
        assert dead.wait(60), "the engine did not notice the dead stage"
        failed = {rid: exc for b in batches for rid, exc in b.failed.items()}
        assert set(failed) == {f"r{i}" for i in range(6)}
        # rank 0's death, or rank 1's broken receive from it: whichever the engine reads first
        assert all(isinstance(exc, ExecutorFailedError) and "worker rank" in str(exc) for exc in failed.values())
        assert len({str(exc) for exc in failed.values()}) == 1
        assert not client.core.batch_queue and not client.core.scheduler.in_flight_request_ids()
    finally:
        client.shutdown()
