"""The BERT family through pagoda.LLM against transformers (tiny random checkpoints, float32).

Each checkpoint is built from a transformers config with seeded weights, saved,
and served by ``LLM``; logits / embeddings are compared with transformers' own
forward of the same model on the same token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM, PoolingParams
from pagoda.testing.tiny_bert import save_tiny_bert

TOKEN_LISTS = [
    [2, 17, 33, 4],
    [2, 9, 4],
    [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 4],
    [2, 40, 41, 42, 4, 50, 51, 4],
    [2, 4],
    [2] + list(range(60, 95)) + [4],
    [2, 88, 77, 66, 55, 44, 4],
    [2, 3, 3, 3, 3, 4],
]


def _hf_outputs(model_dir: Path, model_cls: type, token_lists: list[list[int]],
                token_types: list[list[int]] | None = None) -> list[torch.Tensor]:
    model = model_cls.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for i, ids in enumerate(token_lists):
            kwargs = {}
            if token_types is not None:
                kwargs["token_type_ids"] = torch.tensor([token_types[i]])
            out = model(input_ids=torch.tensor([ids]), **kwargs)
            outs.append(out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0])
    return outs


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "roberta"])
def test_sequence_classification_logits_match_transformers(tmp_path: Path, family: str) -> None:
    model_cls = {
        "bert": transformers.BertForSequenceClassification,
        "roberta": transformers.RobertaForSequenceClassification,
        "xlm-roberta": transformers.XLMRobertaForSequenceClassification,
    }[family]
    model_dir = save_tiny_bert(model_cls, tmp_path / family, num_labels=3)
    expected = _hf_outputs(model_dir, model_cls, TOKEN_LISTS)
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged")
    assert llm.supported_tasks == ("classify", "token_classify")
    raw = llm.classify([{"prompt_token_ids": ids} for ids in TOKEN_LISTS], pooling_params=PoolingParams(use_activation=False))
    for ids, got, want in zip(TOKEN_LISTS, raw, expected):
        torch.testing.assert_close(torch.tensor(got.outputs.probs), want, atol=1e-4, rtol=0, msg=f"{ids}")
    # the logits differ between inputs (a test a constant output would fail)
    assert not torch.allclose(expected[0], expected[1], atol=1e-2)
    probs = llm.classify([{"prompt_token_ids": TOKEN_LISTS[0]}])
    torch.testing.assert_close(torch.tensor(probs[0].outputs.probs), expected[0].softmax(-1), atol=1e-5, rtol=0)
    # one request alone equals the same request in the batch
    alone = llm.classify([{"prompt_token_ids": TOKEN_LISTS[2]}], pooling_params=PoolingParams(use_activation=False))
    torch.testing.assert_close(torch.tensor(alone[0].outputs.probs), torch.tensor(raw[2].outputs.probs), atol=1e-5, rtol=0)


def test_bert_token_type_ids_reach_the_model(tmp_path: Path) -> None:
    model_dir = save_tiny_bert(transformers.BertForSequenceClassification, tmp_path / "bert", num_labels=1)
    ids = TOKEN_LISTS[3]
    types = [0, 0, 0, 0, 0, 1, 1, 1]
    expected = _hf_outputs(model_dir, transformers.BertForSequenceClassification, [ids, ids], [types, [0] * len(ids)])
    assert not torch.allclose(expected[0], expected[1], atol=1e-3)
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged")
    assert "score" in llm.supported_tasks
    out = llm.encode([{"prompt_token_ids": ids, "token_type_ids": types}, {"prompt_token_ids": ids}],
                     PoolingParams(use_activation=False), pooling_task="score")
    torch.testing.assert_close(out[0].outputs.data, expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1].outputs.data, expected[1], atol=1e-4, rtol=0)


def test_bert_model_embeddings_and_poolers(tmp_path: Path) -> None:
    model_dir = save_tiny_bert(transformers.BertModel, tmp_path / "bert")
    hidden = _hf_outputs(model_dir, transformers.BertModel, TOKEN_LISTS)
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged")
    assert llm.supported_tasks == ("embed", "token_embed")
    prompts = [{"prompt_token_ids": ids} for ids in TOKEN_LISTS]
    # BertModel's default pooling is CLS (vLLM's), normalized
    cls = llm.embed(prompts)
    for got, h in zip(cls, hidden):
        torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.nn.functional.normalize(h[0], dim=0),
                                   atol=1e-5, rtol=0)
    raw = llm.embed(prompts[:2], pooling_params=PoolingParams(normalize=False))
    torch.testing.assert_close(torch.tensor(raw[1].outputs.embedding), hidden[1][0], atol=1e-4, rtol=0)
    per_token = llm.encode(prompts, PoolingParams(normalize=False), pooling_task="token_embed")
    for got, h in zip(per_token, hidden):
        torch.testing.assert_close(got.outputs.data, h, atol=1e-4, rtol=0)
    # a config without matryoshka support refuses dimensions
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed(prompts[:1], pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="generative model"):
        llm.generate(["hi"])
    with pytest.raises(ValueError, match="'classify' task"):
        llm.classify(prompts[:1])


def test_pooler_config_overrides_and_matryoshka(tmp_path: Path) -> None:
    model_dir = save_tiny_bert(transformers.BertModel, tmp_path / "bert", matryoshka_dimensions=[8, 16])
    hidden = _hf_outputs(model_dir, transformers.BertModel, TOKEN_LISTS[:3])
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged",
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    prompts = [{"prompt_token_ids": ids} for ids in TOKEN_LISTS[:3]]
    mean = llm.embed(prompts)
    for got, h in zip(mean, hidden):
        torch.testing.assert_close(torch.tensor(got.outputs.embedding), h.mean(0), atol=1e-4, rtol=0)
    cut = llm.embed(prompts, pooling_params=PoolingParams(dimensions=8, normalize=True))
    for got, h in zip(cut, hidden):
        torch.testing.assert_close(torch.tensor(got.outputs.embedding),
                                   torch.nn.functional.normalize(h.mean(0)[:8], dim=0), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"only supports \[8, 16\]"):
        llm.embed(prompts, pooling_params=PoolingParams(dimensions=12))
    last = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged",
               pooler_config={"pooling_type": "LAST"}).embed(prompts)
    torch.testing.assert_close(torch.tensor(last[2].outputs.embedding),
                               torch.nn.functional.normalize(hidden[2][-1], dim=0), atol=1e-5, rtol=0)


def test_bad_pooler_config_is_an_error() -> None:
    from pagoda.config import EngineArgs

    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="chunked processing"):
        EngineArgs(pooler_config={"enable_chunked_processing": True})
    with pytest.raises(ValueError, match="extra"):
        EngineArgs(pooler_config={"no_such_field": 1})


def test_step_pooling_and_encode_task(tmp_path: Path) -> None:
    model_dir = save_tiny_bert(transformers.BertForSequenceClassification, tmp_path / "bert", num_labels=4)
    model = transformers.BertForSequenceClassification.from_pretrained(model_dir).eval()
    ids = [2, 9, 50, 11, 50, 12, 13, 50, 4]
    with torch.no_grad():
        per_token = model.classifier(model.bert(input_ids=torch.tensor([ids])).last_hidden_state[0])
    tag = torch.tensor(ids) == 50
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, attention_backend="torch_paged",
              pooler_config={"pooling_type": "STEP", "step_tag_id": 50, "returned_token_ids": [1, 3]})
    assert llm.supported_tasks == ("token_classify",)  # STEP pools per token: no classify
    out = llm.reward([{"prompt_token_ids": ids}])[0].outputs.data
    torch.testing.assert_close(out, per_token[tag][:, [1, 3]].softmax(-1), atol=1e-5, rtol=0)
    raw = llm.encode([{"prompt_token_ids": ids}], PoolingParams(use_activation=False), pooling_task="encode")
    torch.testing.assert_close(raw[0].outputs.data, per_token[tag][:, [1, 3]], atol=1e-4, rtol=0)
