"""Pooling requests in the engine: one step each, no KV blocks kept, AsyncLLM.encode, the scheduler settings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM, AsyncLLM, EngineArgs, PoolingParams, PoolingRequestOutput, SamplingParams


def _tiny_bert(path: Path) -> Path:
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    config.architectures = ["BertModel"]
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    return path


def test_pooling_requests_hold_no_blocks_and_skip_chunking(tmp_path: Path) -> None:
    model_dir = _tiny_bert(tmp_path / "bert")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.config.scheduler_config.enable_chunked_prefill is False
    assert engine.config.cache_config.enable_prefix_caching is False
    core = engine.engine_core.core
    free = core.kv_cache_manager.num_free_blocks
    prompts = [{"prompt_token_ids": [2] + [5 + i % 50] * n + [3]} for i, n in enumerate((10, 30, 60, 5, 40, 20, 1))]
    # a step holds 64 tokens: the prompts spread over several steps, each whole in its step
    outputs: list[PoolingRequestOutput] = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PoolingParams(task="embed"))
    steps = 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
        assert core.kv_cache_manager.num_free_blocks == free  # nothing held between steps
    assert steps > 2 and len(outputs) == len(prompts)
    assert all(o.finished and o.outputs.data.shape == (32,) for o in outputs)
    with pytest.raises(ValueError, match="longer than this model's maximum length"):
        engine.add_request("long", {"prompt_token_ids": [2] * 65}, PoolingParams(task="embed"))
    with pytest.raises(ValueError, match="cannot generate"):
        engine.add_request("gen", {"prompt_token_ids": [2, 3]}, SamplingParams())


def test_async_encode(tmp_path: Path) -> None:
    model_dir = _tiny_bert(tmp_path / "bert")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype="float32"))
    try:
        assert engine.supported_tasks == ("embed", "token_embed")

        async def run() -> list[PoolingRequestOutput]:
            async def one(i: int) -> PoolingRequestOutput:
                final = None
                async for out in engine.encode({"prompt_token_ids": [2, 7 + i, 9, 3]}, PoolingParams(task="embed"),
                                               f"r{i}"):
                    final = out
                assert final is not None
                return final
            assert await engine.get_supported_tasks() == ("embed", "token_embed")
            with pytest.raises(ValueError, match="not supported by this model"):
                async for _ in engine.encode({"prompt_token_ids": [2, 3]}, PoolingParams(task="classify"), "bad"):
                    pass
            return list(await asyncio.gather(*(one(i) for i in range(4))))

        outs = asyncio.run(run())
        assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
        assert all(abs(float(o.outputs.data.norm()) - 1.0) < 1e-5 for o in outs)
    finally:
        engine.shutdown()
