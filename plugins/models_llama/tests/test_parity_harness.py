"""The shared parity check (pagoda.testing.model_parity) on the Llama family: it passes, and it can fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from pagoda.testing import model_parity
from pagoda.testing.model_parity import build_tiny_model, check_parity

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_llama_passes_with_chunked_prefill_and_prefix_cache_hits(tmp_path: Path) -> None:
    report = check_parity(build_tiny_model(LlamaConfig(**CONFIG)), tmp_path)
    assert report.num_prompts == 13 and report.num_tokens_compared == 13 * 8
    assert report.num_cached_tokens > 0
    assert report.max_logprob_error < 1e-4


def test_a_wrong_weight_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_model = build_tiny_model(LlamaConfig(**CONFIG))
    save = model_parity.save_tiny_model

    def save_perturbed(model: Any, path: Path) -> Path:
        # pagoda serves a checkpoint whose last norm differs slightly from the reference's
        saved = save(model, path)
        with torch.no_grad():
            model.model.norm.weight.mul_(1.05)
        return saved

    monkeypatch.setattr(model_parity, "save_tiny_model", save_perturbed)
    with pytest.raises(AssertionError, match="parity failures"):
        check_parity(hf_model, tmp_path)


def test_too_few_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        model_parity.mixed_prompts(256, num_prompts=4)


def _family_configs() -> dict[str, Any]:
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama-tied": LlamaConfig(**CONFIG, tie_word_embeddings=True),
        "mistral-window24": MistralConfig(**CONFIG, sliding_window=24),
        "qwen2": Qwen2Config(**CONFIG),
        "qwen3": Qwen3Config(**CONFIG, head_dim=32),
    }


@pytest.mark.parametrize("case", ["llama-tied", "mistral-window24", "qwen2", "qwen3"])
def test_every_llama_family_architecture(tmp_path: Path, case: str) -> None:
    check_parity(build_tiny_model(_family_configs()[case], seed=1), tmp_path)


def test_torch_paged_backend(tmp_path: Path) -> None:
    check_parity(build_tiny_model(_family_configs()["mistral-window24"], seed=2), tmp_path,
                 llm_kwargs={"attention_backend": "torch_paged"})
