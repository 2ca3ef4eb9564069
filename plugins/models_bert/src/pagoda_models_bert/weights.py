"""Hugging Face BERT / RoBERTa checkpoint names -> the encoder's parameters.

* ``attention.self.query|key|value`` are stacked into ``attention.self.qkv_proj`` (rows q, k, v).
* The trunk lives under ``bert.`` / ``roberta.`` as in transformers' ``…ForSequenceClassification``;
  a bare ``BertModel`` checkpoint (``embeddings.…``, no prefix) gets the prefix.
* Old TF-converted checkpoints name LayerNorm's weight and bias ``gamma`` / ``beta``.

Core's ``AutoWeightsLoader`` does the loading (each parameter's ``weight_loader``
takes its rank's part): unknown names, tensors a layer cannot take and parameters
left unloaded raise ``ValueError`` naming the weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader

# the fused projection -> the checkpoint's three, in row order (vLLM's packed_modules_mapping)
_QKV = {"qkv_proj": ["query", "key", "value"]}
# buffers some checkpoints carry that the model computes itself
_SKIPPED_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")
_TRUNK_CHILDREN = ("embeddings.", "encoder.", "pooler.")


def _checkpoint_name(name: str, prefix: str) -> str:
    if name.startswith(_TRUNK_CHILDREN):
        name = f"{prefix}.{name}"
    elif prefix != "bert" and name.startswith("bert."):
        name = f"{prefix}.{name[len('bert.'):]}"
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name


def load_bert_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]], prefix: str,
                      ignored_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Load every (HF name, tensor) into ``model``; return the names consumed (ignored ones excluded)."""
    return AutoWeightsLoader(
        model,
        packed_modules_mapping=_QKV,
        skip_suffixes=_SKIPPED_SUFFIXES,
        skip_prefixes=tuple(f"{prefix}.{p}" for p in ignored_prefixes),
        name_mapper=lambda name: _checkpoint_name(name, prefix),
    ).load_weights(weights)
