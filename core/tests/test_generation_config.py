"""Default sampling parameters from the model (vLLM's --generation-config auto|vllm|PATH)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving_common import build_sampling_params
from pagoda.model_loader import ModelLoadError, ModelSource, load_generation_defaults
from pagoda.model_loader.generation_config import DEFAULT_MODEL_SAMPLING

QWEN_LIKE = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
    "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 512,
    "transformers_version": "4.37.0",
}


def _model_dir(tmp_path: Path, generation: dict | None) -> ModelSource:
    (tmp_path / "config.json").write_text("{}")
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return ModelSource(kind="hf", path=tmp_path)


def test_auto_takes_vllms_subset_of_the_models_generation_config(tmp_path: Path) -> None:
    defaults = load_generation_defaults(_model_dir(tmp_path, QWEN_LIKE))
    assert defaults.sampling == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                 "max_tokens": 512}
    assert defaults.eos_token_ids == (151645, 151643)
    assert "Default sampling parameters have been overridden by the model's generation config" in defaults.describe()


def test_vllm_ignores_the_models_sampling_but_keeps_its_eos_ids(tmp_path: Path) -> None:
    defaults = load_generation_defaults(_model_dir(tmp_path, QWEN_LIKE), "vllm")
    assert defaults.sampling == {}
    assert defaults.eos_token_ids == (151645, 151643)
    assert "pagoda's defaults" in defaults.describe()


def test_a_path_and_overrides(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    source = _model_dir(tmp_path, QWEN_LIKE)
    assert load_generation_defaults(source, str(other)).sampling == {"temperature": 0.3}
    overridden = load_generation_defaults(source, "auto", {"temperature": 0.1, "max_new_tokens": 8})
    assert overridden.sampling["temperature"] == 0.1 and overridden.sampling["max_tokens"] == 8
    assert load_generation_defaults(source, "vllm", {"top_p": 0.5}).sampling == {"top_p": 0.5}


def test_errors_name_the_source(tmp_path: Path) -> None:
    source = _model_dir(tmp_path, {"temperature": -1})
    with pytest.raises(ModelLoadError, match="generation config .*temperature must be non-negative"):
        load_generation_defaults(source)
    with pytest.raises(ModelLoadError, match="neither 'auto', 'vllm' nor a directory"):
        load_generation_defaults(source, str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"unknown keys \['temprature'\]"):
        load_generation_defaults(_model_dir(tmp_path, None), "auto", {"temprature": 0.5})


def test_no_generation_config_means_pagodas_defaults(tmp_path: Path) -> None:
    defaults = load_generation_defaults(_model_dir(tmp_path, None))
    assert defaults.sampling == {} and defaults.eos_token_ids == ()


def test_embedded_default_model_gets_its_model_cards_sampling(tmp_path: Path) -> None:
    source = ModelSource(kind="gguf", path=tmp_path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", is_default=True)
    assert load_generation_defaults(source).sampling == DEFAULT_MODEL_SAMPLING == {"temperature": 0.2, "top_p": 0.9}
    assert load_generation_defaults(source, "vllm").sampling == {}


def test_server_requests_take_defaults_only_for_unset_fields() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    unset = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    params = build_sampling_params(unset, 10, None, False, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.2, 0.9, 20, 1.05)
    explicit = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    )
    params = build_sampling_params(explicit, 10, None, False, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.05)
    assert build_sampling_params(unset, 10, None, False).temperature == 1.0  # no defaults: pagoda's own
