"""BERT-family encoders with tensor_parallel_size=2 (mp executor, gloo on loopback) against transformers, float32.

Heads and the intermediate width split across two ranks, the word / position / token-type tables
vocab-parallel (an odd vocabulary padded), the pooler and classifier heads replicated.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pagoda import LLM, PoolingParams
from pagoda.testing.model_parity import TENSOR_PARALLEL_2
from pagoda.testing.tiny_bert import save_tiny_bert

TOKEN_LISTS = [[2, 17, 33, 4], [2, 9, 4], [2] + list(range(60, 95)) + [4], [2, 88, 77, 66, 55, 44, 4]]


def test_bert_classifier_and_embeddings_tp2_match_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny_bert(transformers.BertForSequenceClassification, tmp_path / "bert", num_labels=3, vocab_size=131)
    hf = transformers.BertForSequenceClassification.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    types = [0, 0, 0, 1, 1, 1, 1]
    with torch.no_grad():
        expected = [hf(input_ids=torch.tensor([ids])).logits[0] for ids in TOKEN_LISTS]
        pair = hf(input_ids=torch.tensor([TOKEN_LISTS[3]]), token_type_ids=torch.tensor([types])).logits[0]
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=96, **TENSOR_PARALLEL_2)
    prompts = [{"prompt_token_ids": ids} for ids in TOKEN_LISTS]
    logits = llm.classify(prompts, pooling_params=PoolingParams(use_activation=False))
    for ids, got, want in zip(TOKEN_LISTS, logits, expected):
        torch.testing.assert_close(torch.tensor(got.outputs.probs), want, atol=1e-4, rtol=0, msg=f"{ids}")
    # the second text of a pair: token types other than 0 come from the other rank's half of the table
    typed = llm.encode([{"prompt_token_ids": TOKEN_LISTS[3], "token_type_ids": types}],
                       PoolingParams(use_activation=False), pooling_task="classify")
    torch.testing.assert_close(typed[0].outputs.data, pair, atol=1e-4, rtol=0)
    assert not torch.allclose(pair, expected[3], atol=1e-3)
    assert not torch.allclose(expected[0], expected[1], atol=1e-2)
    del llm
    embedder_dir = save_tiny_bert(transformers.BertModel, tmp_path / "bert-embed", vocab_size=131)
    hf_embed = transformers.BertModel.from_pretrained(embedder_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [hf_embed(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in TOKEN_LISTS]
    embedder = LLM(model=str(embedder_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=96,
                   **TENSOR_PARALLEL_2)
    for got, h in zip(embedder.embed(prompts), hidden):
        torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.nn.functional.normalize(h[0], dim=0),
                                   atol=1e-5, rtol=0)
