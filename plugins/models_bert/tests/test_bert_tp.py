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

TOKEN_LISTS = [[2, 17, 33, 4], [2, 9, 4], [2] + list(range(60, 95)) + [4], [2, 88, 77, 66, 55, 44, 4]]


def _tiny(model_cls: type, path: Path, **extra: object) -> Path:
    config = transformers.BertConfig(vocab_size=131, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=96, hidden_act="gelu", **extra)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.3 if p.ndim == 1 else 0.6)
    model.save_pretrained(path)
    return path


def test_bert_classifier_and_embeddings_tp2_match_transformers(tmp_path: Path) -> None:
    model_dir = _tiny(transformers.BertForSequenceClassification, tmp_path / "bert", num_labels=3)
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
    embedder_dir = _tiny(transformers.BertModel, tmp_path / "bert-embed")
    hf_embed = transformers.BertModel.from_pretrained(embedder_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [hf_embed(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in TOKEN_LISTS]
    embedder = LLM(model=str(embedder_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=96,
                   **TENSOR_PARALLEL_2)
    for got, h in zip(embedder.embed(prompts), hidden):
        torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.nn.functional.normalize(h[0], dim=0),
                                   atol=1e-5, rtol=0)
