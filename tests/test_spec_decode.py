"""Speculative decoding end to end on tiny random models: greedy outputs equal those without speculation
token for token (chunked prefill, prefix-cache hits, preemption, a stop token inside a speculated run),
sampling keeps the target distribution, and every refused combination is a clear error.

Random models rarely repeat, so besides the n-gram proposer the tests use a reference proposer: it drafts
each request's known greedy continuation (from a run without speculation) with a planted wrong token
every few drafts, so runs are accepted, partly accepted and rejected at every position.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from scipy import stats

from pagoda import LLM, SamplingParams
from pagoda.plugins import SpecProposerSpec, get_plugin_manager, hookimpl, reset_plugin_manager
from pagoda.spec_decode import DraftRequest, Proposer

VOCAB = 384


class ReferenceProposer(Proposer):
    """Drafts ``REFERENCE[prompt][len(output):]``; a proposal made after an output length of 1 modulo
    ``WRONG_EVERY`` has its last draft replaced by a wrong token (a function of the request's tokens only,
    so a rerun drafts the same)."""

    name = "reference"
    REFERENCE: dict[tuple[int, ...], list[int]] = {}
    WRONG_EVERY = 3

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.calls = 0
        self.preempted: set[str] = set()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            ref = self.REFERENCE.get(tuple(r.token_ids[: r.num_prompt_tokens]), [])
            done = len(r.token_ids) - r.num_prompt_tokens
            draft = list(ref[done: done + r.max_num_tokens])
            self.calls += 1
            if draft and done % self.WRONG_EVERY == 1:
                draft[-1] = (draft[-1] + 1) % VOCAB
            out.append(draft)
        return out

    def on_preempted(self, req_id: str) -> None:
        self.preempted.add(req_id)


class _Plugin:
    PAGODA_PLUGIN_API_VERSION = "1.6"

    @hookimpl
    def pagoda_register_spec_proposers(self) -> list[SpecProposerSpec]:
        return [SpecProposerSpec("reference", f"{__name__}:ReferenceProposer")]


@pytest.fixture(autouse=True, scope="module")
def _reference_plugin() -> Iterator[None]:
    get_plugin_manager().register(_Plugin(), name="reference-proposer", kind="spec_proposer")
    yield
    reset_plugin_manager()


def _prompts(seed: int, n: int = 10) -> list[list[int]]:
    """Prompts with repeated spans (n-gram matches) and a shared 64-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(64)]
    prompts = []
    for i in range(n):
        span = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
        body = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] + span * rng.randint(2, 5)
        prompts.append((shared if i % 3 == 0 else []) + body)
    return prompts


def _llm(path: Any, **kwargs: Any) -> LLM:
    # 64-token steps chunk the prompts; 20 blocks of 16 cannot hold every sequence at once: preemption
    base = dict(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                max_num_batched_tokens=64, num_kv_blocks=20, block_size=16, enable_prefix_caching=True)
    return LLM(**{**base, **kwargs})


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_reference(tiny_model_dir) -> tuple[Any, list[list[int]], list[list[int]]]:
    path, _ = tiny_model_dir("llama")
    prompts = _prompts(seed=5)
    reference = _run(_llm(path), prompts, GREEDY)
    return path, prompts, reference


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0},
], ids=["ngram", "suffix"])
def test_greedy_plugin_proposers_equal_no_speculation(model_and_reference, config: dict[str, Any]) -> None:
    path, prompts, reference = model_and_reference
    llm = _llm(path, speculative_config=config)
    assert _run(llm, prompts, GREEDY) == reference
    core = _core(llm)
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks
    assert core.make_stats().spec_decoding_stats.num_draft_tokens > 0, "the proposer drafted nothing"
    # a second pass: the suffix proposer's global trie now holds the first pass's outputs and drafts them
    assert _run(llm, prompts, GREEDY) == reference
    if config["method"] == "suffix":
        assert core.make_stats().spec_decoding_stats.num_accepted_tokens > 0


def test_greedy_reference_proposer_equals_no_speculation(model_and_reference) -> None:
    """Most drafts are right: accepted runs move KV and num_computed past several tokens per step."""
    path, prompts, reference = model_and_reference
    ReferenceProposer.REFERENCE = {tuple(p): r for p, r in zip(prompts, reference)}
    llm = _llm(path, speculative_config={"method": "reference", "num_speculative_tokens": 5})
    assert _run(llm, prompts, GREEDY) == reference
    core = _core(llm)
    stats = core.make_stats().spec_decoding_stats
    assert stats.num_accepted_tokens > stats.num_drafts, "drafts were meant to be accepted, several a step"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts were meant to be rejected"
    assert stats.num_accepted_tokens_per_pos[4] > 0
    assert core.scheduler.num_preemptions > 0 and core.scheduler.spec.proposer.preempted
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks
    # the prefix cache holds only real tokens: a fresh run that hits it is still exact
    assert _run(llm, prompts[:3], GREEDY) == reference[:3]


def test_greedy_verify_graphs_single_stream(model_and_reference) -> None:
    """One request at a time: its verify steps (1 + drafts rows) replay CPU kernel graphs, accepted runs
    included, and the tokens are those of no speculation."""
    path, prompts, reference = model_and_reference
    ReferenceProposer.REFERENCE = {tuple(p): r for p, r in zip(prompts, reference)}
    llm = _llm(path, speculative_config={"method": "reference", "num_speculative_tokens": 5})
    graphs = _core(llm).runner.graphs
    if graphs is None or graphs.max_query_len == 1:
        pytest.skip("this platform has no verify-step graphs")
    for prompt, ref in zip(prompts[:4], reference[:4]):
        assert _run(llm, [prompt], GREEDY) == [ref]
    stats = _core(llm).make_stats().spec_decoding_stats
    assert stats.num_accepted_tokens > stats.num_drafts and graphs.num_verify_replays > 0
    assert any(q == 6 for _, q in graphs.verify_steps), "no verify step of all 5 drafts replayed"


def test_stop_token_inside_a_speculated_run(model_and_reference) -> None:
    """A stop token (and max_tokens) landing inside an accepted run ends the output right there."""
    path, prompts, reference = model_and_reference
    ReferenceProposer.REFERENCE = {tuple(p): r for p, r in zip(prompts, reference)}
    params = []
    for ref in reference:
        stop = ref[17]
        params.append(SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                                     logprobs=2))
    plain = _llm(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = _llm(path, speculative_config={"method": "reference", "num_speculative_tokens": 5})
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        # logprobs of accepted tokens are the target's own
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert _core(llm).make_stats().spec_decoding_stats.num_accepted_tokens > 0


def _position_counts(outs: list[list[int]], position: int) -> Counter[int]:
    return Counter(o[position] for o in outs)


def _homogeneity_p_value(a: Counter[int], b: Counter[int]) -> float:
    """Chi-square test that two samples come from one distribution (rare tokens pooled)."""
    tokens = sorted(set(a) | set(b))
    table = np.array([[a[t] for t in tokens], [b[t] for t in tokens]], dtype=np.float64)
    common = table.sum(axis=0) >= 10
    pooled = table[:, ~common].sum(axis=1, keepdims=True)
    table = np.concatenate((table[:, common], pooled), axis=1) if pooled.sum() else table[:, common]
    return float(stats.chi2_contingency(table).pvalue)


def _sampled(llm: LLM, prompt: list[int], seeds: range) -> list[list[int]]:
    params = [SamplingParams(max_tokens=4, temperature=0.8, top_k=40, frequency_penalty=0.3, seed=s,
                             ignore_eos=True) for s in seeds]
    return _run(llm, [prompt] * len(params), params)


def _distribution_check(path: Any, prompt: list[int], reference: list[int]) -> float:
    ReferenceProposer.REFERENCE = {tuple(prompt): reference}
    plain = _sampled(_llm(path, num_kv_blocks=512, max_num_seqs=128), prompt, range(600))
    llm = _llm(path, num_kv_blocks=512, max_num_seqs=128,
               speculative_config={"method": "reference", "num_speculative_tokens": 3})
    spec = _sampled(llm, prompt, range(600, 1200))
    assert _core(llm).make_stats().spec_decoding_stats.num_accepted_tokens > 0
    return min(_homogeneity_p_value(_position_counts(plain, i), _position_counts(spec, i)) for i in range(1, 4))


def test_sampling_distribution_unchanged(model_and_reference) -> None:
    path, prompts, reference = model_and_reference
    assert _distribution_check(path, prompts[1], reference[1]) > 1e-3


def test_sampling_check_catches_accepting_every_draft(model_and_reference, monkeypatch) -> None:
    import torch

    from pagoda.sample import rejection

    monkeypatch.setattr(rejection, "_uniforms", lambda n, generators, device: torch.zeros(n, device=device))
    path, prompts, reference = model_and_reference
    assert _distribution_check(path, prompts[1], reference[1]) < 1e-6


@pytest.mark.parametrize("config,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa'"),
    ({"model": "some/draft-model", "num_speculative_tokens": 2}, "'draft_model'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "larger"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,)]"}, "speculative_token_tree"),
    ({"method": "ngram", "num_speculative_tokens": 2, "no_such_key": 1}, "no_such_key"),
    ({"method": "nothing_installed", "num_speculative_tokens": 2}, "nothing_installed"),
])
def test_refused_configs(tiny_model_dir, config: dict[str, Any], message: str) -> None:
    path, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=message):
        _llm(path, speculative_config=config)


def test_beam_search_and_pipeline_parallel_refused(tiny_model_dir) -> None:
    from pagoda.beam_search import BeamSearchParams

    path, _ = tiny_model_dir("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="pipeline parallelism"):
        _llm(path, speculative_config=spec, pipeline_parallel_size=2)
    llm = _llm(path, speculative_config=spec)
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], BeamSearchParams(beam_width=2, max_tokens=4))


def test_sampling_parameters_with_speculation(model_and_reference) -> None:
    """Penalties, logit bias, allowed_token_ids, min_tokens, a logits processor and n > 1 give
    the same greedy tokens with speculation; seeded sampling repeats."""
    path, prompts, reference = model_and_reference
    ReferenceProposer.REFERENCE = {tuple(p): r for p, r in zip(prompts, reference)}
    allowed = sorted(set(reference[2][:30]) | {7, 8, 9})

    def no_token_five(output_ids: list[int], logits: Any) -> Any:
        logits[5] = float("-inf")
        return logits

    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias={reference[3][4]: -100.0}),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=10, stop_token_ids=[reference[4][3]]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logits_processors=[no_token_five]),
        # n > 1 needs temperature > 0: top_k=1 keeps the samples deterministic
        SamplingParams(max_tokens=30, temperature=1.0, top_k=1, ignore_eos=True, n=3),
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts[: len(params)]]
    plain = _llm(path).generate(inputs, params, use_tqdm=False)
    llm = _llm(path, speculative_config={"method": "reference", "num_speculative_tokens": 4})
    spec = llm.generate(inputs, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert _core(llm).make_stats().spec_decoding_stats.num_accepted_tokens > 0
    # seeded requests repeat under the same schedule (how many drafts a step verifies decides how many
    # draws a request's generator gives, so a different batch may sample differently, as in vLLM)
    seeded = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    spec_config = {"method": "reference", "num_speculative_tokens": 4}
    runs = [_run(_llm(path, speculative_config=spec_config), prompts[:6], seeded) for _ in range(2)]
    assert runs[0] == runs[1]


def test_disable_by_batch_size_through_the_engine(model_and_reference) -> None:
    """Six requests decoding together (same prompt length and max_tokens: they finish in the same step) never
    draft with disable_by_batch_size=4; the same requests do draft without it, and the tokens are the same."""
    path, _, _ = model_and_reference
    rng = random.Random(11)
    span = [rng.randrange(VOCAB) for _ in range(4)]
    prompts = [[rng.randrange(VOCAB)] + span * 5 for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # room for all six at once: no preemption, so all six run until the end
    base = dict(max_num_batched_tokens=256, num_kv_blocks=64)
    limited = _llm(path, speculative_config={**config, "disable_by_batch_size": 4}, **base)
    free = _llm(path, speculative_config=config, **base)
    assert _run(limited, prompts, params) == _run(free, prompts, params)
    assert _core(limited).make_stats().spec_decoding_stats is None, "drafted with 6 running > 4"
    assert _core(free).make_stats().spec_decoding_stats.num_draft_tokens > 0
