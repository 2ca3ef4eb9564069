"""Sleep mode offline (vLLM's ``LLM.sleep(level)`` / ``wake_up()``): what it frees and that greedy output survives."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 9, 17, 33, 2], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    path, _ = tiny_model_dir("llama")
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_restores_greedy_output(llm: LLM, level: int, tiny_model_dir: Any,
                                                         hf_greedy: Any) -> None:
    _, hf = tiny_model_dir("llama")
    before = _ids(llm)
    assert before == [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = llm.llm_engine.engine_core.core.runner
    llm.sleep(level=level)
    assert llm.llm_engine.is_sleeping()
    assert runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attn_layers)
    assert (runner.model is None) == (level == 2)
    with pytest.raises(ValueError, match="asleep"):
        _ids(llm)
    with pytest.raises(ValueError, match="asleep already"):
        llm.sleep(level=1)
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert _ids(llm) == before


def test_sleep_frees_the_kv_cache_that_kernel_graphs_captured_with_the_heap_frozen(llm: LLM) -> None:
    """An engine-core process freezes its start-up heap out of the collector: the graphs' reference cycles
    (runner -> capturer -> roots -> runner) must not keep the KV cache alive through sleep there."""
    _ids(llm)
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.graphs is not None and runner.graphs.steps, "the decode steps ran without kernel graphs"
    caches = [weakref.ref(cache) for cache in runner.kv_caches]
    gc.collect()
    gc.freeze()
    try:
        llm.sleep(level=1)
        assert [c for c in caches if c() is not None] == []
    finally:
        gc.unfreeze()
        llm.wake_up()
    assert runner.graphs is not None
    _ids(llm)
    assert runner.graphs.steps  # captured again over the new cache


def test_sleep_level_2_frees_the_weights_with_the_heap_frozen(llm: LLM) -> None:
    """Each parameter's ``weight_loader`` names its own layer (a bound method): a cycle that, with the
    start-up heap frozen as in an engine-core process, kept the embedding's weight through sleep level 2."""
    before = _ids(llm)
    runner = llm.llm_engine.engine_core.core.runner
    weights = {name: weakref.ref(p) for name, p in runner.model.named_parameters()}
    caches = [weakref.ref(cache) for cache in runner.kv_caches]
    gc.collect()
    gc.freeze()
    try:
        llm.sleep(level=2)
        assert [name for name, w in weights.items() if w() is not None] == []
        assert [c for c in caches if c() is not None] == []
    finally:
        gc.unfreeze()
        llm.wake_up()
    assert _ids(llm) == before


def test_sleep_needs_enable_sleep_mode_and_a_valid_level(tiny_model_dir: Any, llm: LLM) -> None:
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    path, _ = tiny_model_dir("llama")
    plain = LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep(level=1)
    assert len(_ids(plain)) == 2  # refused, and still serving


def test_served_sleep_on_a_one_model_server(tiny_model_dir: Any, start_server: Any) -> None:
    """vLLM's /sleep, /wake_up, /is_sleeping (PAGODA_SERVER_DEV_MODE=1) on the one-model server."""
    import httpx

    path, _ = tiny_model_dir("llama")
    server = start_server([str(path), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256",
                           "--num-kv-blocks", "64", "--enable-sleep-mode"], env={"PAGODA_SERVER_DEV_MODE": "1"})
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    def ids() -> list[str]:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["logprobs"]["tokens"])

    before = ids()
    for level in (1, 2):
        assert httpx.post(server.url + "/sleep", params={"level": level}, timeout=60).status_code == 200
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert httpx.post(server.url + "/wake_up", timeout=120).status_code == 200
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert ids() == before
    assert httpx.get(server.url + "/health").status_code == 200
