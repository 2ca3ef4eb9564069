"""A tiny random BERT embedding checkpoint for the example processor's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def write_checkpoint(path: Path) -> Path:
    """BertModel (seeded, wide init) + a word-level BERT tokenizer (words w5 .. w63)."""
    import transformers as tf

    from pagoda.testing.tiny_tokenizer import save_tiny_bert_tokenizer

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32, initializer_range=0.3)
    tf.BertModel(config, add_pooling_layer=False).eval().save_pretrained(path, safe_serialization=True)
    save_tiny_bert_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="session")
def bert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def example() -> Any:
    """The helpers above for the test modules (under --import-mode=importlib they cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(PLUGIN_ROOT=PLUGIN_ROOT, write_checkpoint=write_checkpoint)
