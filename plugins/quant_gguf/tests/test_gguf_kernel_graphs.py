"""GGUF kept in blocks under CPU kernel graphs: decode steps replayed from the recorded kernel calls
(the block matmuls, the quantized token table's dequantize between them) give the eager engine's
tokens and logprobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pagoda import LLM, SamplingParams
from plugins.quant_gguf.tests.test_gguf_models import VOCAB, write_tiny_llama


@pytest.mark.parametrize("qtype, vocab_qtype", [(Q.Q4_1, Q.Q8_0), (Q.Q4_K, None)], ids=["q4_1_q8_0_vocab", "q4_k"])
def test_replayed_decode_matches_eager(tmp_path: Path, qtype: Q, vocab_qtype: Q | None) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype, vocab_qtype)
    engines = [LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=32,
                   block_size=16, max_num_seqs=4, enforce_eager=eager) for eager in (False, True)]
    graphs = engines[0].llm_engine.engine_core.core.runner.graphs
    assert graphs is not None and engines[1].llm_engine.engine_core.core.runner.graphs is None
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, VOCAB, 3 + 4 * i).tolist()} for i in range(3)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=3) for i in range(3)]
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    for g, e in zip(got, want):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lg, le in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert lg.keys() == le.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lg], [le[t].logprob for t in le], rtol=1e-5, atol=1e-5)
    assert graphs.num_replays > 0
