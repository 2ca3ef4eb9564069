"""PoolingParams (vLLM's checks), PoolerConfig and the sentence-transformers files, torch-free parts of pagoda.pooling."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagoda import PoolingParams
from pagoda.pooling.config import PoolerConfig, load_sentence_transformers_config, suffix_defaults


def _model(**kw: object) -> SimpleNamespace:
    base = dict(pooler_config=PoolerConfig(), is_matryoshka=False, matryoshka_dimensions=None, served_model_name="m")
    base.update(kw)
    return SimpleNamespace(**base)


def test_task_defaults() -> None:
    p = PoolingParams()
    p.verify("embed", _model())
    assert (p.task, p.normalize, p.use_activation) == ("embed", True, None)
    p = PoolingParams()
    p.verify("classify", _model())
    assert (p.normalize, p.use_activation) == (None, True)
    p = PoolingParams(activation=False)  # vLLM's old name
    assert p.use_activation is False and p.activation is None


def test_pooler_config_defaults_merge_under_the_request() -> None:
    model = _model(pooler_config=PoolerConfig(normalize=False, use_activation=False))
    p = PoolingParams()
    p.verify("embed", model)
    assert p.normalize is False
    p = PoolingParams(normalize=True)
    p.verify("embed", model)
    assert p.normalize is True


def test_refusals() -> None:
    with pytest.raises(ValueError, match="does not support matryoshka"):
        PoolingParams(dimensions=8).verify("embed", _model())
    with pytest.raises(ValueError, match=r"only supports \[64, 128\]"):
        PoolingParams(dimensions=8).verify("embed", _model(is_matryoshka=True, matryoshka_dimensions=(64, 128)))
    PoolingParams(dimensions=64).verify("embed", _model(is_matryoshka=True, matryoshka_dimensions=(64, 128)))
    with pytest.raises(ValueError, match="does not support \\['normalize'\\]"):
        PoolingParams(normalize=True).verify("classify", _model())
    with pytest.raises(ValueError, match="does not support \\['use_activation'\\]"):
        PoolingParams(use_activation=True).verify("embed", _model())
    with pytest.raises(ValueError, match="overwrite"):
        PoolingParams(task="embed").verify("classify", _model())
    with pytest.raises(ValueError, match="positive"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="not a pooling task"):
        PoolingParams(task="generate")  # type: ignore[arg-type]


def _st_dir(tmp_path: Path, modules: list[dict[str, str]], pooling: dict[str, bool] | None,
            bert: dict[str, object] | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if bert is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return tmp_path


TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_sentence_transformers_files(tmp_path: Path) -> None:
    st = load_sentence_transformers_config(_st_dir(
        tmp_path, [TRANSFORMER, POOLING, NORMALIZE],
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False},
        {"max_seq_length": 128, "do_lower_case": True}))
    assert st.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)
    assert (st.max_seq_length, st.do_lower_case) == (128, True)
    assert load_sentence_transformers_config(tmp_path / "1_Pooling").pooler_config is None  # no files: nothing


def test_sentence_transformers_modules_pagoda_cannot_apply(tmp_path: Path) -> None:
    dense = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    with pytest.raises(ValueError, match="Dense"):
        load_sentence_transformers_config(_st_dir(tmp_path / "a", [TRANSFORMER, POOLING, dense],
                                                  {"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_sentence_transformers_config(_st_dir(tmp_path / "b", [TRANSFORMER, POOLING],
                                                  {"pooling_mode_max_tokens": True}))


def test_pooler_config_names() -> None:
    assert PoolerConfig(**{"pooling_type": "cls", "softmax": False}) == PoolerConfig(pooling_type="CLS",
                                                                                     use_activation=False)
    assert PoolerConfig(pooling_type="LAST").merged_over(PoolerConfig(pooling_type="MEAN", normalize=True)) == \
        PoolerConfig(pooling_type="LAST", normalize=True)


@pytest.mark.parametrize(("arch", "expected"), [
    ("LlamaForCausalLM", ("generate", "none")), ("BertModel", ("pooling", "embed")),
    ("Qwen2ForSequenceClassification", ("pooling", "classify")), ("Qwen2ForRewardModel", ("pooling", "reward")),
])
def test_suffix_defaults(arch: str, expected: tuple[str, str]) -> None:
    assert suffix_defaults(arch) == expected
