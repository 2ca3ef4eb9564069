"""distributed_executor_backend='ray' on a local Ray cluster bound to loopback (started and stopped here).

Greedy tokens equal transformers' (float32) for a tiny Llama at TP=2, a tiny Qwen3 at TP=2 x PP=2 and a tiny
Llama at PP=2 with two batches in flight (the stages overlap); a
killed rank fails the requests in flight with a clear error and leaves no actor behind. Skipped only where ray cannot be imported (it is in the test extra).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.executor import ExecutorFailedError  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def local_ray() -> Any:
    """A private Ray cluster on 127.0.0.1 for this module: no dashboard, one logical CPU per rank of TP=2 x PP=2."""
    # a small object store: a step's SchedulerOutput is a few KB
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4, object_store_memory=100 * 2**20,
             logging_level="WARNING")
    yield ray
    ray.shutdown()


def _prompts(vocab: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _all_dead(actors: list[Any]) -> bool:
    for actor in actors:
        try:
            ray.get(actor.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            continue
        return False
    return True


def _llm(path: Any, tp: int, pp: int = 1) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=256,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray")


def _check_greedy(llm: LLM, hf_model: Any, hf_greedy: Any, divergence_is_a_tie: Any) -> None:
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        expected = hf_greedy(hf_model, p, NEW_TOKENS)
        got = o.outputs[0].token_ids
        assert got == expected or divergence_is_a_tie(hf_model, p, got, expected), (p, got, expected)


def test_ray_tp2_greedy_matches_transformers_then_a_killed_rank_fails_the_requests(
        local_ray: Any, tiny_model_dir: Any, hf_greedy: Any, divergence_is_a_tie: Any) -> None:
    """One engine for both checks: Ray actors are slow to start on 2 cores."""
    from pagoda.executor.ray_executor import RayDistributedExecutor

    path, hf_model = tiny_model_dir("llama")
    llm = _llm(path, tp=2)
    engine = llm.llm_engine
    executor = engine.engine_core.core.model_executor
    actors = list(executor.workers)
    try:
        assert isinstance(executor, RayDistributedExecutor) and len(actors) == 2
        _check_greedy(llm, hf_model, hf_greedy, divergence_is_a_tie)

        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3 + i]}, params)
        engine.step()
        engine.step()
        ray.kill(actors[1])
        with pytest.raises(ExecutorFailedError, match=r"worker rank [01] .*(died|failed)"):
            for _ in range(50):
                engine.step()
        # every actor killed, the placement group gone, the test's cluster left running (the executor joined it)
        assert _all_dead(actors) and not executor.workers and executor.pg is None
        assert ray.is_initialized()
        with pytest.raises(ExecutorFailedError):
            engine.engine_core.core.check_health()
    finally:
        engine.engine_core.shutdown()


def test_ray_tp2_pp2_greedy_matches_transformers(local_ray: Any, tiny_model_dir: Any, hf_greedy: Any,
                                                 divergence_is_a_tie: Any) -> None:
    path, hf_model = tiny_model_dir("qwen3")
    llm = _llm(path, tp=2, pp=2)
    executor = llm.llm_engine.engine_core.core.model_executor
    actors = list(executor.workers)
    try:
        assert len(actors) == 4 and executor.output_rank == 2
        _check_greedy(llm, hf_model, hf_greedy, divergence_is_a_tie)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert _all_dead(actors) and executor.pg is None


def test_ray_pp2_two_batches_in_flight_greedy_matches_transformers(local_ray: Any, tiny_model_dir: Any,
                                                                   hf_greedy: Any, divergence_is_a_tie: Any) -> None:
    """16 requests on two stages, split over two batches in flight: each actor runs its calls in order,
    so stage 1 starts batch k + 1 while stage 2 still runs batch k (their step times overlap)."""
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=128,
              max_num_batched_tokens=64, pipeline_parallel_size=2, distributed_executor_backend="ray")
    core = llm.llm_engine.engine_core.core
    executor = core.model_executor
    actors = list(executor.workers)
    try:
        assert core.batch_queue_size == 2 == executor.max_concurrent_batches
        executor.collective_rpc("get_step_times")  # forget the start-up
        rng = random.Random(1)
        prompts = [[rng.randrange(hf_model.config.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(16)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            expected = hf_greedy(hf_model, p, NEW_TOKENS)
            got = o.outputs[0].token_ids
            assert got == expected or divergence_is_a_tie(hf_model, p, got, expected), (p, got, expected)
        first, last = executor.collective_rpc("get_step_times")
        assert len(first) == len(last) > NEW_TOKENS
        assert any(first[k + 1][0] < last[k][1] for k in range(len(first) - 1)), "the stages never overlapped"
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert _all_dead(actors) and executor.pg is None
