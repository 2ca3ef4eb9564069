"""Beam search inside the scheduler equals transformers' beam search (num_beams, no sampling)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagoda import LLM
from pagoda.sampling_params import BeamSearchParams

MAX_TOKENS = 10


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _hf_beams(model: Any, prompt: list[int], width: int, eos: int | None, length_penalty: float,
              early_stopping: bool | str) -> list[tuple[list[int], float]]:
    """transformers' W best hypotheses: (generated tokens, score), best first."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width, do_sample=False,
        max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
        early_stopping=early_stopping, return_dict_in_generate=True, output_scores=True,
    )
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in seq:
            seq = seq[: seq.index(eos) + 1]  # the rest is padding
        beams.append((seq, score))
    return beams


def _eos_token(hf_model: Any, prompts: list[list[int]]) -> int:
    """A token the model often emits early, so that EOS ends some beams and not others."""
    counts: dict[int, int] = {}
    for p in prompts:
        ids = torch.tensor([p])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        for t in out[0, len(p):].tolist()[1:]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.__getitem__)


def _check(llm: LLM, hf_model: Any, prompts: list[list[int]], width: int, eos: int | None,
           length_penalty: float, early_stopping: bool | str = False) -> list[str]:
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=eos is None,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, early_stopping=early_stopping)
    reasons: list[str] = []
    for p, out in zip(prompts, outs):
        expected = _hf_beams(hf_model, p, width, eos, length_penalty, early_stopping)
        got = [(s.tokens[len(p):], s.cum_logprob) for s in out.sequences]
        assert [g[0] for g in got] == [e[0] for e in expected], (p, got, expected)
        for (tokens, cum), (_, score) in zip(got, expected):
            assert cum / len(tokens) ** length_penalty == pytest.approx(score, abs=1e-4)
        assert all(s.tokens[: len(p)] == p for s in out.sequences)
        reasons += [s.finish_reason for s in out.sequences]
    kv = llm.llm_engine.engine_core.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "beams leaked KV blocks"
    assert not llm.llm_engine.has_unfinished_requests()
    return reasons


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def eos_token(tiny):
    """``_eos_token`` of the tiny model, worked out once per prompt set: the EOS tests of one seed
    (every width and length penalty) all ask for the same one, and each asking costs a transformers
    generate per prompt."""
    _, hf_model = tiny
    found: dict[tuple[tuple[int, ...], ...], int] = {}

    def get(prompts: list[list[int]]) -> int:
        key = tuple(map(tuple, prompts))
        if key not in found:
            found[key] = _eos_token(hf_model, prompts)
        return found[key]

    return get


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers_without_eos(tiny, width: int) -> None:
    path, hf_model = tiny
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              num_kv_blocks=512, block_size=16)
    prompts = _prompts(6, hf_model.config.vocab_size, seed=width)
    reasons = _check(llm, hf_model, prompts, width, eos=None, length_penalty=1.0)
    assert set(reasons) == {"length"}


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beam_search_matches_transformers_with_eos(tiny, eos_token, width: int, length_penalty: float) -> None:
    path, hf_model = tiny
    prompts = _prompts(6, hf_model.config.vocab_size, seed=21)
    eos = eos_token(prompts)
    # small blocks: beams fork inside partial blocks, so copy-on-write happens
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              num_kv_blocks=512, block_size=4, hf_overrides={"eos_token_id": eos})
    reasons = _check(llm, hf_model, prompts, width, eos=eos, length_penalty=length_penalty)
    if length_penalty <= 1.0:
        # (a length penalty of 2 favours long beams so much that none ending in EOS makes the top W here)
        assert "stop" in reasons, "EOS was meant to end some beams"


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_beam_search_early_stopping_modes(tiny, eos_token, early_stopping: bool | str) -> None:
    path, hf_model = tiny
    prompts = _prompts(4, hf_model.config.vocab_size, seed=21)
    eos = eos_token(prompts)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              num_kv_blocks=512, block_size=4, hf_overrides={"eos_token_id": eos})
    _check(llm, hf_model, prompts, 3, eos=eos, length_penalty=1.5, early_stopping=early_stopping)


def test_beam_search_under_preemption_and_small_batch(tiny) -> None:
    """Too few blocks and rows for every beam at once: beams are preempted and groups wait; results hold."""
    path, hf_model = tiny
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
              num_kv_blocks=20, block_size=4, max_num_seqs=8)
    prompts = _prompts(6, hf_model.config.vocab_size, seed=5)
    _check(llm, hf_model, prompts, 4, eos=None, length_penalty=1.0)
    assert llm.llm_engine.engine_core.core.scheduler.num_preemptions > 0


def test_beam_search_runs_beside_sampling_and_abort_frees_blocks(tiny) -> None:
    from pagoda import SamplingParams

    path, hf_model = tiny
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              num_kv_blocks=512, block_size=4)
    engine = llm.llm_engine
    prompts = _prompts(3, hf_model.config.vocab_size, seed=8)
    engine.add_beam_search_request("beams", {"prompt_token_ids": prompts[0]}, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True))
    engine.add_request("plain", {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    engine.add_beam_search_request("aborted", {"prompt_token_ids": prompts[2]}, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True))
    done: dict[str, Any] = {}
    for step in range(100):
        if step == 3:
            engine.abort_request("aborted")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {"beams", "plain"}
    assert len(done["beams"].outputs) == 4
    kv = engine.engine_core.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
