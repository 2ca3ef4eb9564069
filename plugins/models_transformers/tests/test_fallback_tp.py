"""The transformers fallback refuses tensor parallelism: its layers are transformers' own, which nothing splits."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagoda.distributed import parallel_state
from pagoda.distributed.parallel_state import GroupCoordinator
from pagoda_models_transformers.model import TransformersForCausalLM
from pagoda_models_transformers.support import FallbackUnsupportedError


def _gpt2() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                   architectures=["GPT2LMHeadModel"])


def test_tensor_parallel_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 of 2 (no process group: the refusal comes before any collective)
    monkeypatch.setattr(parallel_state, "_TP", GroupCoordinator([0, 1], 0, None))
    with pytest.raises(FallbackUnsupportedError, match="GPT2LMHeadModel with tensor parallelism.*tensor_parallel_size=1"):
        TransformersForCausalLM(_gpt2(), torch.float32)


def test_one_rank_builds() -> None:
    model = TransformersForCausalLM(_gpt2(), torch.float32)
    assert model.architecture == "GPT2LMHeadModel"
