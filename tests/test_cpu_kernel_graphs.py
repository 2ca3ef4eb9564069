"""CPU kernel graphs through the whole engine: pure-decode steps replayed from a recorded program
(pagoda.cpp_extension.graph) give the tokens and logprobs of the same engine run eagerly.

Each test runs one engine with graphs (the CPU default) and one with ``enforce_eager=True`` on the
same tiny random checkpoint. The kernels are the same either way, so results must match exactly
apart from logprob rounding in the last place."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams


def _requests(vocab: int, n: int, seed: int) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]} for _ in range(n)]
    # different lengths: the decode batch shrinks through every size, padded into the captured ones
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=3) for i in range(n)]
    return prompts, params


def _engine(path: Any, dtype: str, eager: bool, **kwargs: Any) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=128, num_kv_blocks=64,
               enable_prefix_caching=False, max_num_seqs=8, enforce_eager=eager, **kwargs)


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.runner


def _assert_same(graphs: list[Any], eager: list[Any]) -> None:
    for i, (g, e) in enumerate(zip(graphs, eager)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs"
        for lg, le in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert lg.keys() == le.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lg], [le[t].logprob for t in le], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_decode_matches_eager(tiny_model_dir: Any, dtype: str) -> None:
    path, hf_model = tiny_model_dir("llama")
    with_graphs, eager = _engine(path, dtype, eager=False), _engine(path, dtype, eager=True)
    assert _runner(eager).graphs is None
    graphs = _runner(with_graphs).graphs
    # each size is captured on its first decode step, none at start-up
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and not graphs.steps
    prompts, params = _requests(hf_model.config.vocab_size, 7, seed=3)
    _assert_same(with_graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))
    assert graphs.num_replays >= 10
    assert sorted(graphs.steps) == [1, 2, 4, 8]  # the batch shrank 7 -> 1 through every size
    prompts, params = _requests(hf_model.config.vocab_size, 5, seed=4)
    _assert_same(with_graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))


def test_sampled_and_fp8_cache_decode_match_eager(tiny_model_dir: Any) -> None:
    path, hf_model = tiny_model_dir("qwen3")  # per-head q/k norms: torch ops between kernels
    kwargs = dict(kv_cache_dtype="fp8")
    with_graphs, eager = _engine(path, "bfloat16", eager=False, **kwargs), _engine(path, "bfloat16", eager=True, **kwargs)
    prompts, _ = _requests(hf_model.config.vocab_size, 4, seed=5)
    params = [SamplingParams(max_tokens=6 + i, temperature=0.9, top_p=0.9, seed=10 + i, logprobs=2) for i in range(4)]
    _assert_same(with_graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))
    assert _runner(with_graphs).graphs.num_replays > 0


def test_a_forward_that_cannot_be_captured_runs_eagerly(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path, hf_model = tiny_model_dir("llama")
    eager = _engine(path, "float32", eager=True)
    model_cls = type(_runner(eager).model)
    forward = model_cls.forward

    def reads_a_value(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input_ids.tolist() == [-1]:  # a host read of the data, as a graph-unsafe model might do
            raise AssertionError("unreachable")
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(model_cls, "forward", reads_a_value)
    with_graphs = _engine(path, "float32", eager=False)
    prompts, params = _requests(hf_model.config.vocab_size, 3, seed=6)
    with caplog.at_level("INFO", logger="pagoda.worker.graphs"):
        # the first decode step tries the capture, fails, and that step and every later one run eagerly
        _assert_same(with_graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))
    graphs = _runner(with_graphs).graphs
    assert graphs is not None and graphs.off and not graphs.steps and graphs.num_replays == 0
    assert "kernel graphs off, every step runs eagerly" in caplog.text and "tolist" in caplog.text


def test_graph_sizes_follow_the_config(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model_dir("llama")
    assert _runner(_engine(path, "float32", eager=False, cuda_graph_sizes=[3, 6])).graphs.sizes == [3, 6]
    monkeypatch.setenv("PAGODA_CPU_KERNEL_GRAPHS", "0")
    assert _runner(_engine(path, "float32", eager=False)).graphs is None



def test_calculated_fp8_scales_are_in_the_graph(tiny_model_dir: Any) -> None:
    """calculate_kv_scales derives the scales in the first step; the kernels take them as values, so the
    capture waits for that step (captured before it, every replay would use 1.0)."""
    path, hf_model = tiny_model_dir("llama")
    kwargs = dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    with_graphs, eager = _engine(path, "bfloat16", eager=False, **kwargs), _engine(path, "bfloat16", eager=True, **kwargs)
    graphs = _runner(with_graphs).graphs
    assert graphs is not None and not graphs.steps, "nothing captured before the first step"
    prompts, params = _requests(hf_model.config.vocab_size, 4, seed=7)
    _assert_same(with_graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))
    assert sorted(graphs.steps) == [1, 2, 4] and graphs.num_replays > 0  # 4 requests: sizes 4, 2, 1
    assert all(layer._k_scale_float != 1.0 for layer in _runner(with_graphs).attn_layers)


def test_replayed_verify_steps_match_eager(tiny_model_dir: Any) -> None:
    """Speculative verify steps (every request 1 + k rows) replay graphs per (batch size, rows): the
    tokens and logprobs are those of the same speculation run eagerly, and greedy equals no speculation."""
    path, hf_model = tiny_model_dir("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with_graphs = _engine(path, "float32", eager=False, speculative_config=spec)
    eager = _engine(path, "float32", eager=True, speculative_config=spec)
    plain = _engine(path, "float32", eager=True)
    graphs = _runner(with_graphs).graphs
    assert graphs is not None and graphs.max_query_len == 4 and not graphs.verify_steps
    rng = random.Random(7)
    # repeated spans: the n-gram proposer drafts; one request at a time, then three together
    prompts = []
    for _ in range(4):
        span = [rng.randrange(hf_model.config.vocab_size) for _ in range(rng.randint(2, 6))]
        prompts.append({"prompt_token_ids": span * rng.randint(3, 6)})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for batch in ([prompts[0]], [prompts[1]], prompts[1:]):
        replayed = with_graphs.generate(batch, params, use_tqdm=False)
        _assert_same(replayed, eager.generate(batch, params, use_tqdm=False))
        reference = plain.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in replayed] == [o.outputs[0].token_ids for o in reference]
    assert graphs.num_verify_replays > 0 and graphs.verify_steps, "no verify step replayed a graph"
    assert all(1 < q <= 4 for _, q in graphs.verify_steps)
    # (a random model rarely continues a repetition: accepted runs are tested in test_spec_decode.py)
