"""A tiny BERT-family checkpoint (BERT, RoBERTa, XLM-RoBERTa heads) with weights large enough to tell inputs apart.

transformers' own initialization (std 0.02) gives near-constant outputs at this size, so a test
comparing pagoda with transformers could pass with the inputs ignored; weights drawn at std 0.6
(0.3 for biases and other 1-D parameters, LayerNorm scales around 1) make outputs differ clearly
between inputs while staying finite in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_BERT_CONFIG: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=96, hidden_act="gelu",
)


def save_tiny_bert(model_cls: type, path: str | Path, **config: Any) -> Path:
    """Save a seeded ``model_cls`` (e.g. ``transformers.BertForSequenceClassification``) into ``path``.

    Its config is ``model_cls.config_class`` with ``TINY_BERT_CONFIG`` overridden by ``config``
    (``num_labels``, ``vocab_size``, ``matryoshka_dimensions``, ...); ``architectures`` names
    ``model_cls``. Returns ``path``.
    """
    import torch

    config_cls = getattr(model_cls, "config_class", None)
    if config_cls is None:
        raise TypeError(f"{model_cls.__name__} is not a transformers model class (it has no config_class)")
    hf_config = config_cls(**{**TINY_BERT_CONFIG, **config})
    hf_config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.3 if p.ndim == 1 else 0.6)
    model.save_pretrained(path)
    return Path(path)
