"""An engine on the CPU faults its lazily mapped KV cache in at start-up, and generates as before."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.worker.host_memory import PAGE, populate, resident_pages, zeros_lazy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux")


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner


def test_engine_prefaults_its_kv_cache_and_generates_the_same(
    tiny_model_dir: Any, hf_greedy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    if populate([zeros_lazy((PAGE,), torch.uint8, torch.device("cpu"))]) != PAGE:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setenv("PAGODA_CPU_KVCACHE_PREFAULT", "1")  # the default outside the test suite (conftest.py)
    path, model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20)
    for cache in _runner(llm).kv_caches:
        resident, total = resident_pages(cache)
        assert resident == total
    prompt = [5, 17, 3, 99, 42, 7]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(model, prompt, 8)


def test_prefault_off_leaves_the_cache_lazy(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KVCACHE_PREFAULT", "0")
    path, _ = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=256 << 20)
    resident = sum(resident_pages(cache)[0] for cache in _runner(llm).kv_caches)
    total = sum(resident_pages(cache)[1] for cache in _runner(llm).kv_caches)
    assert resident < total // 2  # only what the start-up's steps wrote
