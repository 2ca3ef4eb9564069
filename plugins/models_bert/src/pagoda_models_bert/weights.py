"""Hugging Face BERT / RoBERTa checkpoint names -> the encoder's parameters.

* ``attention.self.query|key|value`` are stacked into ``attention.self.qkv_proj`` (rows q, k, v).
* The trunk lives under ``bert.`` / ``roberta.`` as in transformers' ``…ForSequenceClassification``;
  a bare ``BertModel`` checkpoint (``embeddings.…``, no prefix) gets the prefix.
* Old TF-converted checkpoints name LayerNorm's weight and bias ``gamma`` / ``beta``.

Unknown names, shape mismatches and parameters left unloaded raise ``ValueError``
naming the weight (parameters start as ``torch.empty``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_QKV = {"query": 0, "key": 1, "value": 2}
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
    """Copy each (HF name, tensor) into ``model``; return the names consumed (ignored ones excluded)."""
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {}
    loaded: set[str] = set()
    ignored = tuple(f"{prefix}.{p}" for p in ignored_prefixes)
    with torch.no_grad():
        for original, tensor in weights:
            if original.endswith(_SKIPPED_SUFFIXES):
                continue
            name = _checkpoint_name(original, prefix)
            if name.startswith(ignored):
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 3 and parts[-3] == "self" and parts[-2] in _QKV:
                shard = _QKV[parts[-2]]
                name = ".".join([*parts[:-2], "qkv_proj", parts[-1]])
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint weight {original!r} matches no parameter of {type(model).__name__}")
            target = param.data
            if shard is not None:
                rows = target.shape[0] // 3
                target = target.narrow(0, shard * rows, rows)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint weight {original!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
            target.copy_(tensor)
            filled.setdefault(name, set()).update({shard} if shard is not None else {0, 1, 2})
            loaded.add(original)
    missing = [n for n in params if len(filled.get(n, set())) < 3]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded
