"""Architectures served through the transformers fallback match transformers end to end (``pagoda.LLM``).

The shared parity check: greedy tokens identical to transformers' float32 ``generate``
and top-5 logprobs within 1e-3 over a mixed batch of 13 prompts, with chunked prefill
(32-token step budget), continuous batching and prefix-cache hits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from pagoda import LLM
from pagoda.models.registry import UnsupportedArchitectureError
from pagoda.testing.model_parity import build_tiny_model, check_parity, randomize_weights, save_tiny_model

FALLBACK_LOG = "through the transformers fallback (pagoda-models-transformers)"


def _gpt_bigcode(multi_query: bool) -> Any:
    return transformers.GPTBigCodeConfig(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, multi_query=multi_query, n_positions=256,
        bos_token_id=0, eos_token_id=0,
    )


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_gpt_bigcode_only_transformers_implements_runs_through_the_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, multi_query: bool
) -> None:
    hf_model = build_tiny_model(_gpt_bigcode(multi_query), seed=0)
    with caplog.at_level(logging.INFO, logger="pagoda.worker.model_runner"):
        report = check_parity(hf_model, tmp_path)  # model_impl="auto": no family implements GPTBigCode
    assert f"Serving GPTBigCodeForCausalLM {FALLBACK_LOG}" in caplog.text
    assert report.num_tokens_compared == report.num_prompts * 8 and not report.near_ties
    assert report.num_cached_tokens > 0


@pytest.mark.parametrize("case", ["mistral-window", "gemma2-softcaps-alternating-windows"])
def test_forced_fallback_matches_transformers_with_windows_and_soft_caps(tmp_path: Path, case: str) -> None:
    small: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=16,
    )
    if case == "mistral-window":
        config: Any = transformers.MistralConfig(**small)
    else:
        config = transformers.Gemma2Config(**small, head_dim=16)
    # prompts up to 120 tokens: the 16-token windows cut in
    report = check_parity(build_tiny_model(config, seed=0), tmp_path, llm_kwargs={"model_impl": "transformers"})
    assert not report.near_ties


_REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "pagoda_remote_llama"
'''
_REMOTE_MODELING = '''from transformers import LlamaForCausalLM

from .configuration_remote import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
'''


def _remote_code_model(tmp_path: Path) -> Any:
    """A model whose config and model classes live in its own directory (auto_map), as hub repos ship them."""
    source = tmp_path / "remote-source"
    source.mkdir()
    (source / "configuration_remote.py").write_text(_REMOTE_CONFIG)
    (source / "modeling_remote.py").write_text(_REMOTE_MODELING)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ).to_dict()
    config.update(
        model_type="pagoda_remote_llama",
        architectures=["RemoteLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteLlamaConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM",
        },
    )
    import json

    (source / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(source, trust_remote_code=True, local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        hf_config, trust_remote_code=True, attn_implementation="eager", dtype=torch.float32
    ).eval()
    randomize_weights(model, seed=0)
    assert type(model).__name__ == "RemoteLlamaForCausalLM" and not hasattr(transformers, "RemoteLlamaForCausalLM")
    return model


def test_trust_remote_code_serves_the_directorys_own_model_through_the_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _remote_code_model(tmp_path)
    with caplog.at_level(logging.INFO, logger="pagoda.worker.model_runner"):
        report = check_parity(model, tmp_path / "trusted", llm_kwargs={"trust_remote_code": True})
    assert f"Serving RemoteLlamaForCausalLM {FALLBACK_LOG}" in caplog.text
    assert not report.near_ties


def test_remote_code_is_refused_without_trust_remote_code(tmp_path: Path) -> None:
    saved = save_tiny_model(_remote_code_model(tmp_path), tmp_path / "saved")
    assert (saved / "modeling_remote.py").exists()  # save_pretrained ships the code with the weights
    with pytest.raises(Exception, match="trust_remote_code=True"):
        LLM(model=str(saved), skip_tokenizer_init=True, dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_bloom_alibi_is_a_clear_error_naming_the_reason(tmp_path: Path) -> None:
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    saved = save_tiny_model(build_tiny_model(config, seed=0), tmp_path / "bloom")
    with pytest.raises(UnsupportedArchitectureError) as caught:
        LLM(model=str(saved), skip_tokenizer_init=True, dtype="float32", max_model_len=64, num_kv_blocks=16)
    message = str(caught.value)
    assert "BloomForCausalLM" in message and "_supports_attention_backend is False" in message
    assert "cannot be served by the transformers fallback (pagoda-models-transformers)" in message
    assert "Installed model families:" in message
