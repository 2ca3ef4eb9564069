"""Decode graphs through the whole engine on a tiny random Llama: graph replays vs eager steps.

On CPU the "capture" is ``EagerReplay`` (the forward re-run eagerly over the
static buffers) with a test-only attention backend on the torch reference
kernels: that checks bucketing, static-buffer filling and padding in the real
runner, not CUDA graphs. The ``gpu`` tests capture real CUDA graphs with the
platform's own backend; they are skipped without a CUDA device.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import pagoda.worker.model_runner as model_runner_module
from pagoda import LLM, SamplingParams
from pagoda.attention import AttentionBackend, AttentionLayerParams, AttentionMetadata
from pagoda.worker import graphs
from pagoda.worker.graphs import CudaGraphCapture, EagerReplay
from pagoda_kernels import paged_decode_attention_torch, paged_prefill_attention_torch, reshape_and_cache_torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU_SIZES = [1, 2, 4, 8]


class ReferenceGraphBackend(AttentionBackend[AttentionMetadata]):
    """The torch reference kernels with no per-step planning: what a graph-safe backend looks like to the runner.

    (Its kernels sync with the host, so it could not really be captured; EagerReplay never captures.)
    """

    name: ClassVar[str] = "test_reference_graphs"
    supports_cuda_graphs: ClassVar[bool] = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, params: AttentionLayerParams) -> torch.Tensor:
        reshape_and_cache_torch(key, value, kv_cache, metadata.slot_mapping)
        scale, window, cap = params.scale, params.sliding_window, params.logits_soft_cap
        if metadata.is_all_decode:
            return paged_decode_attention_torch(query, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                                                window, cap)
        return paged_prefill_attention_torch(query, kv_cache, metadata.block_tables, metadata.query_start_loc,
                                             metadata.seq_lens, scale, window, cap)


@pytest.fixture
def eager_replay_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CPU runner build decode graphs: a graph-capable backend, capture sizes, EagerReplay."""
    monkeypatch.setattr(model_runner_module, "select_attention_backend", lambda *a, **k: ReferenceGraphBackend)
    monkeypatch.setattr(graphs, "capture_sizes_for", lambda platform, config: list(CPU_SIZES))
    from pagoda_platform_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "graph_capturer", lambda self, roots: (EagerReplay(), ""))


def _requests(vocab: int, n: int, seed: int) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 100))]} for _ in range(n)]
    # Different lengths: the decode batch shrinks one request at a time through every bucket.
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=2) for i in range(n)]
    return prompts, params


def _graphs_vs_eager(llm: LLM, prompts: list[dict[str, Any]], params: list[SamplingParams]) -> int:
    """Generate with graphs, then again with graphs off on the same engine; returns the replay count."""
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.graphs is not None
    with_graphs = llm.generate(prompts, params, use_tqdm=False)
    replays = runner.graphs.num_replays
    saved, runner.graphs = runner.graphs, None
    try:
        eager = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.graphs = saved
    for i, (g, e) in enumerate(zip(with_graphs, eager)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs"
        for lg, le in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert lg.keys() == le.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lg], [le[t].logprob for t in le], rtol=1e-4, atol=1e-4)
    return replays


def _null_block_untouched(llm: LLM) -> bool:
    """Block 0 is the reserved null block padding rows read: nothing may ever write it."""
    return all(not cache[:, 0].any() for cache in llm.llm_engine.engine_core.core.runner.kv_caches)


@pytest.mark.usefixtures("eager_replay_graphs")
@pytest.mark.parametrize("chunked_budget", [None, 48], ids=["whole_prompts", "chunked_mixed_steps"])
def test_replayed_decode_matches_eager_token_for_token(tiny_model_dir, chunked_budget: int | None) -> None:
    path, hf_model = tiny_model_dir("llama")
    kwargs: dict[str, Any] = {} if chunked_budget is None else dict(max_num_batched_tokens=chunked_budget)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=200,
              enable_prefix_caching=False, max_num_seqs=16, **kwargs)
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.graphs is not None and runner.graphs.sizes == CPU_SIZES
    # 11 requests: 9..11 decode eagerly (past the largest size), 8 and below replay, padded to 8, 4, 2, 1.
    prompts, params = _requests(hf_model.config.vocab_size, 11, seed=1)
    replays = _graphs_vs_eager(llm, prompts, params)
    assert replays > 0
    assert _null_block_untouched(llm)


@pytest.mark.usefixtures("eager_replay_graphs")
def test_seeded_sampling_and_prompt_logprobs_match_eager(tiny_model_dir) -> None:
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=200,
              enable_prefix_caching=False, max_num_seqs=16)
    prompts, _ = _requests(hf_model.config.vocab_size, 6, seed=4)
    params = [SamplingParams(max_tokens=6 + i, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=1) for i in range(6)]
    # A request with prompt logprobs keeps every step it is in eager; the others still replay.
    params[0] = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, logprobs=1)
    assert _graphs_vs_eager(llm, prompts, params) > 0


@pytest.mark.usefixtures("eager_replay_graphs")
def test_padding_rows_write_no_kv_and_leave_real_rows_alone(tiny_model_dir) -> None:
    """One padded replay (3 real rows in the 4 graph, stale rows from an 8 replay) vs the same step eagerly."""
    path, _ = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_seqs=16)
    runner = llm.llm_engine.engine_core.core.runner
    g = runner.graphs
    assert g is not None
    rng = np.random.default_rng(0)
    bs = runner.block_size

    def step(n: int, first_block: int) -> dict[str, np.ndarray]:
        seq = rng.integers(2, 3 * bs, n)
        bt = (first_block + 3 * np.arange(n)[:, None] + np.arange(3)[None, :]).astype(np.int32)
        pos = seq - 1
        return dict(input_ids=rng.integers(1, 300, n), positions=pos,
                    slot_mapping=bt[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs,
                    seq_lens=seq, block_tables=bt, num_scheduled=np.ones(n, dtype=np.int64))

    assert g.replay(**step(8, first_block=1)) is not None  # fills all 8 rows with real data
    real = step(3, first_block=30)
    before = [c.clone() for c in runner.kv_caches]
    out = g.replay(**real)
    assert out is not None and out.shape[0] == 3
    after_graph = [c.clone() for c in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)

    with torch.inference_mode():
        md = AttentionMetadata(
            num_seqs=3, num_tokens=3, query_start_loc=torch.arange(4, dtype=torch.int32),
            seq_lens=torch.from_numpy(real["seq_lens"].astype(np.int32)),
            block_tables=torch.from_numpy(real["block_tables"]), slot_mapping=torch.from_numpy(real["slot_mapping"]),
            max_query_len=1, max_seq_len=int(real["seq_lens"].max()), is_all_decode=True,
        )
        want = runner.model(torch.from_numpy(real["input_ids"]), torch.from_numpy(real["positions"]),
                            runner.attn_backend.prepare(md))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for graph_cache, eager_cache, saved in zip(after_graph, runner.kv_caches, before):
        torch.testing.assert_close(graph_cache, eager_cache)
        changed = (graph_cache != saved).any(dim=-1).any(dim=-1).any(dim=0).flatten()  # per slot
        assert set(torch.nonzero(changed).flatten().tolist()) <= set(real["slot_mapping"].tolist())


@gpu
def test_cuda_graphs_match_eager_on_the_device(tiny_model_dir) -> None:
    path, hf_model = tiny_model_dir("llama")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=200,
              enable_prefix_caching=False, max_num_seqs=16)
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.attn_backend.name == "triton_paged"
    assert runner.graphs is not None and isinstance(runner.graphs.capturer, CudaGraphCapture)
    assert runner.graphs.sizes == [1, 2, 4, 8, 16]  # the CUDA platform's defaults for max_num_seqs=16
    prompts, params = _requests(hf_model.config.vocab_size, 20, seed=2)
    assert _graphs_vs_eager(llm, prompts, params) > 0
    assert _null_block_untouched(llm)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_half_precision_agree_with_eager(tiny_model_dir, dtype: str) -> None:
    path, hf_model = tiny_model_dir("qwen3")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=512, num_kv_blocks=200,
              enable_prefix_caching=False, max_num_seqs=8)
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.graphs is not None
    prompts, _ = _requests(hf_model.config.vocab_size, 6, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_graphs = llm.generate(prompts, params, use_tqdm=False)
    saved, runner.graphs = runner.graphs, None
    eager = llm.generate(prompts, params, use_tqdm=False)
    runner.graphs = saved
    # Padding changes matmul shapes, so 16-bit rounding may differ; the first tokens must agree.
    for g, e in zip(with_graphs, eager):
        assert g.outputs[0].token_ids[:4] == e.outputs[0].token_ids[:4]


@gpu
def test_enforce_eager_captures_nothing(tiny_model_dir) -> None:
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    path, _ = tiny_model_dir("llama")
    config = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                        num_kv_blocks=64, enforce_eager=True).create_engine_config()
    engine = LLMEngine(config)
    assert engine.engine_core.core.runner.graphs is None
