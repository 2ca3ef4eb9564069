"""Sampling semantics end to end on a tiny random model, checked against transformers' own logits."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.logits_processors import NamedLogitsProcessor
from pagoda.plugins import LogitsProcessorSpec, get_plugin_manager, hookimpl, reset_plugin_manager


def _prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _ref_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at every position of ``ids``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].to(torch.float32)
    return logits.log_softmax(dim=-1)


def _tokens(out: Any) -> list[list[int]]:
    return [o.token_ids for o in out.outputs]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.core.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    path, _ = tiny
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_kv_blocks=1024,
               block_size=16)


def test_n4_returns_four_different_samples(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": _prompt(20, 1)}, SamplingParams(n=4, temperature=1.0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)[0]
    samples = _tokens(out)
    assert len(samples) == 4 and all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) == 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    _assert_no_leak(llm)


def test_best_of_returns_the_best_child_by_cumulative_logprob(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _prompt(15, 2)}
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=77, logprobs=0)
    children = llm.generate(prompt, SamplingParams(n=4, best_of=4, **base), use_tqdm=False)[0].outputs
    for child in children:
        # the cumulative logprob is the sum of the sampled tokens' logprobs
        total = sum(record[tok].logprob for tok, record in zip(child.token_ids, child.logprobs))
        assert child.cumulative_logprob == pytest.approx(total, abs=1e-4)
    best = max(children, key=lambda c: c.cumulative_logprob)
    out = llm.generate(prompt, SamplingParams(n=1, best_of=4, **base), use_tqdm=False)[0]
    assert len(out.outputs) == 1
    assert out.outputs[0].token_ids == best.token_ids
    assert out.outputs[0].cumulative_logprob == pytest.approx(best.cumulative_logprob, abs=1e-5)
    # n=2 of 4: the two best, best first
    two = llm.generate(prompt, SamplingParams(n=2, best_of=4, **base), use_tqdm=False)[0].outputs
    ranked = sorted(children, key=lambda c: -c.cumulative_logprob)[:2]
    assert [o.token_ids for o in two] == [c.token_ids for c in ranked]
    _assert_no_leak(llm)


def test_seeded_requests_repeat_across_runs_and_batches(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _prompt(30, 3)}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = _tokens(llm.generate(prompt, seeded, use_tqdm=False)[0])
    again = _tokens(llm.generate(prompt, seeded, use_tqdm=False)[0])
    others = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=99, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, n=3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, top_p=0.5, max_tokens=13, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": _prompt(10 + 7 * i, 100 + i)} for i in range(8)]
    mixed = llm.generate(prompts[:4] + [prompt] + prompts[4:], others[:4] + [seeded] + others[4:], use_tqdm=False)
    assert alone == again
    assert _tokens(mixed[4]) == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    assert _tokens(llm.generate(prompt, unseeded, use_tqdm=False)[0]) != alone
    _assert_no_leak(llm)


def test_logprobs_and_ranks_match_transformers(llm: LLM, tiny) -> None:
    _, hf_model = tiny
    prompt = _prompt(25, 4)
    k = 5
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=6, logprobs=k,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ref = _ref_logprobs(hf_model, prompt + out.token_ids[:-1])
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for j, (tok, record) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert next(iter(record)) == tok  # the sampled token comes first
        assert record[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert record[tok].rank == 1  # greedy
        top_values, top_ids = row.topk(k)
        for rank, (value, t) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
            assert record[t].logprob == pytest.approx(value, abs=1e-4)
            assert record[t].rank == rank
        assert len(record) == k
        total += row[tok].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_sampled_token_rank_matches_transformers(llm: LLM, tiny) -> None:
    _, hf_model = tiny
    prompt = _prompt(12, 5)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.5, seed=5, max_tokens=8, logprobs=2,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ref = _ref_logprobs(hf_model, prompt + out.token_ids[:-1])
    for j, (tok, record) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert record[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert record[tok].rank == int((row >= row[tok]).sum())


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_match_transformers_with_chunked_prefill(tiny, prefix_caching: bool) -> None:
    path, hf_model = tiny
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_kv_blocks=512,
              block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=32,
              enable_prefix_caching=prefix_caching)
    prompt = _prompt(100, 6)
    k = 3
    ref = _ref_logprobs(hf_model, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k, ignore_eos=True)
    # the second run finds the prompt in the prefix cache, yet must compute every prompt position again
    for _ in range(2):
        # a second request in the same steps shifts the chunk boundaries
        outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": _prompt(40, 7)}],
                            [params, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)], use_tqdm=False)
        out = outs[0]
        assert out.num_cached_tokens == 0
        assert outs[1].prompt_logprobs is None
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt)
        assert plp[0] is None
        for i in range(1, len(prompt)):
            record, row, tok = plp[i], ref[i - 1], prompt[i]
            assert next(iter(record)) == tok
            assert record[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert record[tok].rank == int((row >= row[tok]).sum())
            top_values, top_ids = row.topk(k)
            for rank, (value, t) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
                assert record[t].logprob == pytest.approx(value, abs=1e-4)
                assert record[t].rank == rank
    _assert_no_leak(llm)


def test_prompt_logprobs_of_n_sequences_are_computed_once(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": _prompt(9, 8)}, SamplingParams(n=3, temperature=1.0, max_tokens=2,
                                                                           prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 9 and out.prompt_logprobs[0] is None
    assert all(len(r) == 1 for r in out.prompt_logprobs[1:])


def test_min_tokens_suppresses_eos_and_stop_tokens(tiny, hf_greedy) -> None:
    path, hf_model = tiny
    prompt = _prompt(20, 9)
    greedy = hf_greedy(hf_model, prompt, 12)
    j = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    eos = greedy[j]
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=256,
              hf_overrides={"eos_token_id": eos})
    ids = {"prompt_token_ids": prompt}
    stopped = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy[: j + 1] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    held = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, min_tokens=j + 3), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= j + 3
    assert eos not in held.token_ids[: j + 3]
    # a stop token id: reported as the stop reason, and held back by min_tokens in the same way
    stop_tok = greedy[j]
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == greedy[: j + 1] and plain.stop_reason == stop_tok
    held = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok],
                                            min_tokens=j + 2), use_tqdm=False)[0].outputs[0]
    assert stop_tok not in held.token_ids[: j + 2]
    _assert_no_leak(llm)


def test_abort_mid_generation_frees_every_block(llm: LLM) -> None:
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": _prompt(40 + i, 10 + i)},
                           SamplingParams(n=2 if i == 1 else 1, temperature=1.0, max_tokens=100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    kv = engine.engine_core.core.kv_cache_manager
    assert kv.num_free_blocks < kv.num_usable_blocks
    engine.abort_request(["abort-0", "abort-1"])
    engine.abort_request("abort-2")
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert engine.step() == []  # late outputs of aborted requests are dropped


class _ForceToken:
    """A stateful processor class: every instance forces its own token."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.calls = 0

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        forced = torch.full_like(logits, float("-inf"))
        forced[self.token] = 0.0
        return forced


def _ban_even(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    logits[0::2] = float("-inf")
    return logits


class _FakeLogitsPlugin:
    PAGODA_PLUGIN_API_VERSION = "1.0"

    @hookimpl
    def pagoda_register_logits_processors(self) -> list[LogitsProcessorSpec]:
        return [
            LogitsProcessorSpec("force_token", f"{__name__}:_ForceToken"),
            LogitsProcessorSpec("ban_even", f"{__name__}:_ban_even"),
        ]


@pytest.fixture
def fake_logits_plugin():
    get_plugin_manager().register(_FakeLogitsPlugin(), name="fake-logits", kind="logits_processor")
    yield
    reset_plugin_manager()


def test_logits_processors_by_plugin_name(llm: LLM, fake_logits_plugin) -> None:
    prompt = {"prompt_token_ids": _prompt(10, 12)}
    forced = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                                 logits_processors=[NamedLogitsProcessor("force_token", 42)]),
                          use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [42] * 5
    odd = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                                              logits_processors=[NamedLogitsProcessor("ban_even")]), use_tqdm=False)[0]
    assert all(t % 2 == 1 for t in odd.outputs[0].token_ids)
    with pytest.raises(ValueError, match="unknown logits processor 'nope'.*force_token"):
        llm.generate(prompt, SamplingParams(logits_processors=[NamedLogitsProcessor("nope")]), use_tqdm=False)
    with pytest.raises(ValueError, match="is a function"):
        llm.generate(prompt, SamplingParams(logits_processors=[NamedLogitsProcessor("ban_even", 1)]), use_tqdm=False)
    _assert_no_leak(llm)


def test_block_accounting_after_parallel_sampling(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": _prompt(30 + 5 * i, 20 + i)} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(n=3, best_of=5, temperature=1.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outs)
    _assert_no_leak(llm)
