"""Hugging Face checkpoints: path resolution, config, weights in safetensors (single/sharded) and .bin, dtype, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagoda.model_loader import (
    ModelLoadError,
    ModelNotFoundError,
    ModelSource,
    checkpoint_dtype,
    iter_weights,
    load_hf_config,
    resolve_model_path,
)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,  # so lm_head is saved and compared too
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def single_dir(model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("single")
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sharded_dir(model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(directory, max_shard_size="20KB")
    return directory


@pytest.fixture(scope="module")
def bin_dir(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # transformers 5 only writes safetensors; a .bin checkpoint is what older versions left: config + torch.save
    directory = tmp_path_factory.mktemp("bin")
    model.config.save_pretrained(directory)
    torch.save(state_dict, directory / "pytorch_model.bin")
    return directory


def assert_same_weights(yielded: list[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> None:
    names = [name for name, _ in yielded]
    assert len(names) == len(set(names)), "a tensor was yielded twice"
    assert set(names) == set(expected)
    for name, tensor in yielded:
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


def test_resolves_hf_directory(single_dir: Path) -> None:
    source = resolve_model_path(str(single_dir))
    assert source == ModelSource(kind="hf", path=single_dir.resolve())


def test_single_safetensors_round_trip(single_dir: Path, state_dict: dict[str, torch.Tensor]) -> None:
    assert_same_weights(list(iter_weights(resolve_model_path(single_dir))), state_dict)


def test_sharded_safetensors_round_trip(sharded_dir: Path, state_dict: dict[str, torch.Tensor]) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the fixture must really be sharded"
    assert_same_weights(list(iter_weights(resolve_model_path(sharded_dir), "safetensors")), state_dict)


def test_bin_round_trip(bin_dir: Path, state_dict: dict[str, torch.Tensor]) -> None:
    source = resolve_model_path(bin_dir)
    assert_same_weights(list(iter_weights(source)), state_dict)
    assert_same_weights(list(iter_weights(source, "pt")), state_dict)


def test_safetensors_preferred_over_bin(single_dir: Path, tmp_path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    directory = tmp_path / "both"
    directory.mkdir()
    for file in single_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    # a .bin holding different values: if it were read, the comparison would fail
    torch.save({name: torch.zeros_like(t) for name, t in state_dict.items()}, directory / "pytorch_model.bin")
    source = resolve_model_path(directory)
    assert_same_weights(list(iter_weights(source)), state_dict)
    assert all(not t.any() for _, t in iter_weights(source, "pt"))


def test_config_and_overrides(single_dir: Path) -> None:
    source = resolve_model_path(single_dir)
    config = load_hf_config(source)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == 32 and config.num_key_value_heads == 2
    overridden = load_hf_config(source, {"architectures": ["MyLlama"], "max_position_embeddings": 16})
    assert overridden.architectures == ["MyLlama"]
    assert overridden.max_position_embeddings == 16


def test_checkpoint_dtype(single_dir: Path, tmp_path: Path) -> None:
    assert checkpoint_dtype(resolve_model_path(single_dir)) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_dtype(resolve_model_path(tmp_path)) is None


def test_dummy_yields_nothing(single_dir: Path) -> None:
    assert list(iter_weights(resolve_model_path(single_dir), "dummy")) == []


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model_path(str(missing))


def test_directory_without_weights(tmp_path: Path, model: LlamaForCausalLM) -> None:
    model.config.save_pretrained(tmp_path)
    source = resolve_model_path(tmp_path)
    with pytest.raises(ModelLoadError, match="has no weights"):
        iter_weights(source)
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        iter_weights(source, "safetensors")


def test_directory_without_config_or_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a config.json"):
        resolve_model_path(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    file = tmp_path / "weights.txt"
    file.write_text("x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_path(file)


def test_unknown_load_format(single_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="Unknown load_format 'tensorflow'"):
        iter_weights(resolve_model_path(single_dir), "tensorflow")


def test_gguf_format_on_hf_directory(single_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        iter_weights(resolve_model_path(single_dir), "gguf")


def test_shard_index_with_missing_file(sharded_dir: Path, tmp_path: Path) -> None:
    for file in sharded_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    first_shard = sorted(tmp_path.glob("*.safetensors"))[0]
    first_shard.unlink()
    with pytest.raises(ModelLoadError, match=first_shard.name):
        iter_weights(resolve_model_path(tmp_path))
