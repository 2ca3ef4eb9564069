"""Greedy outputs are token-for-token identical to transformers' generate (float32)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagoda import LLM, SamplingParams

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_greedy(hf_greedy):
    """The session's ``hf_greedy``, each (model, prompt, length) generated once: the four chunked-prefill and
    prefix-caching cases compare the same 16 prompts on the same model, so three of four reference runs
    repeat the first. Its results hold a reference to the model, so an id is never reused while cached."""
    found: dict[tuple[int, tuple[int, ...], int], tuple[Any, list[int]]] = {}

    def greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (id(model), tuple(prompt), max_new_tokens)
        if key not in found:
            found[key] = (model, hf_greedy(model, prompt, max_new_tokens))
        return list(found[key][1])

    return greedy


def _prompts(n: int, vocab: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(max(0, n - 2))]
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths[:n]]


def _check(hf_greedy, llm: LLM, hf_model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
           divergence_is_a_tie=None) -> None:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatches = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        expected = hf_greedy(hf_model, p, new_tokens)
        if o.outputs[0].token_ids != expected:
            # Random weights can produce exact near-ties (top-2 logits 1e-6 apart); there the
            # order of float additions decides and neither engine is wrong. Anything else fails.
            if not (divergence_is_a_tie and divergence_is_a_tie(hf_model, p, o.outputs[0].token_ids, expected)):
                mismatches.append((i, len(p), o.outputs[0].token_ids, expected))
        assert o.outputs[0].finish_reason == "length"
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} differ, first: {mismatches[0]}"


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_greedy_matches_transformers(tiny_model_dir, hf_greedy, divergence_is_a_tie, kind: str, batch: int) -> None:
    path, hf_model = tiny_model_dir(kind)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_kv_blocks=2048)
    _check(hf_greedy, llm, hf_model, _prompts(batch, hf_model.config.vocab_size, seed=batch),
           divergence_is_a_tie=divergence_is_a_tie)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_and_prefix_caching(tiny_model_dir, hf_greedy, divergence_is_a_tie, chunked: bool, prefix_caching: bool) -> None:
    path, hf_model = tiny_model_dir("llama")
    budget = 64 if chunked else 512
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              enable_chunked_prefill=chunked, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching,
              num_kv_blocks=2048)
    prompts = _prompts(12, hf_model.config.vocab_size, seed=7)
    # shared prefixes exercise the prefix cache
    prompts += [prompts[1][:200] + p[:20] for p in prompts[2:6]]
    _check(hf_greedy, llm, hf_model, prompts, divergence_is_a_tie=divergence_is_a_tie)


def test_preemption_keeps_results_exact(tiny_model_dir, hf_greedy, divergence_is_a_tie) -> None:
    path, hf_model = tiny_model_dir("llama")
    # 40 blocks of 16 tokens cannot hold 16 sequences of ~100 tokens at once
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              num_kv_blocks=40, block_size=16)
    prompts = _prompts(16, hf_model.config.vocab_size, seed=3, max_len=120)
    _check(hf_greedy, llm, hf_model, prompts, new_tokens=24, divergence_is_a_tie=divergence_is_a_tie)
    core = llm.llm_engine.engine_core.core
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be too small to avoid preemption"
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks


def test_prefix_cache_reuses_blocks(tiny_model_dir, hf_greedy) -> None:
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_kv_blocks=256)
    prefix = _prompts(2, hf_model.config.vocab_size, seed=11, max_len=300)[1][:256]
    first = llm.generate({"prompt_token_ids": prefix + [1, 2, 3]}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prefix + [4, 5, 6]}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 256  # 16 full blocks of the shared prefix were not recomputed
    _check(hf_greedy, llm, hf_model, [prefix + [4, 5, 6]], new_tokens=2)


def test_eager_steps_compute_only_the_sampled_rows_past_the_last_attention(tiny_model_dir, hf_greedy,
                                                                            divergence_is_a_tie) -> None:
    """The runner hands a model that supports it the rows that sample (output_rows), chunks that sample
    nothing included; results stay transformers' own, and prompt logprobs (every row) still get them all."""
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              max_num_batched_tokens=64, num_kv_blocks=2048, enforce_eager=True, enable_prefix_caching=False)
    runner = llm.llm_engine.engine_core.core.runner
    seen: list[tuple[int, int | None]] = []
    forward = runner.model.forward

    def spy(input_ids, positions, metadata, *args, **kwargs):
        rows = kwargs.get("output_rows")
        out = forward(input_ids, positions, metadata, *args, **kwargs)
        seen.append((len(input_ids), None if rows is None else len(rows)))
        assert len(out) == (len(input_ids) if rows is None else len(rows))
        return out

    runner.model.forward = spy
    prompts = _prompts(6, hf_model.config.vocab_size, seed=11, max_len=150)
    _check(hf_greedy, llm, hf_model, prompts, divergence_is_a_tie=divergence_is_a_tie)
    assert any(rows is not None and 0 < rows < tokens for tokens, rows in seen)
    seen.clear()
    _check(hf_greedy, llm, hf_model, prompts[1:2], divergence_is_a_tie=divergence_is_a_tie)
    assert seen[:3] == [(64, 0), (64, 0), (len(prompts[1]) - 128, 1)], "64-token chunks of a longer prompt sample nothing"

    seen.clear()
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompts[1])
    assert seen and all(rows is None for _, rows in seen), "prompt logprobs read every row's hidden state"
