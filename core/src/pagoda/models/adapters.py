"""Generative model classes turned into pooling ones (vLLM's ``as_embedding_model`` / ``as_seq_cls_model`` /
``as_reward_model``), so every decoder family embeds, classifies and rewards without its own pooling code.

The converted class is a subclass of the family's: its ``forward`` already
returns the final hidden states ``[T, hidden]``; the conversion adds a pooler,
drops the LM head (an untied one is never loaded; a tied one is the embedding
anyway) and, for ``classify``, a ``score`` head of ``num_labels`` rows read from
the checkpoint's ``score.weight`` as transformers' ``…ForSequenceClassification``
stores it. Checkpoints saved from the bare decoder (``Qwen2Model``: names
without the ``model.`` prefix) load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagoda.layers import ReplicatedLinear
from pagoda.models.interface import PoolingModel, config_for, is_pooling_model
from pagoda.pooling.config import PoolerConfig
from pagoda.pooling.pooler import DispatchPooler, Pooler, classification_pooler, embedding_pooler

CONVERT_TYPES = ("embed", "classify", "reward")


class _NoLMHead(nn.Module):
    """Stands where an untied LM head was: a pooling model never computes logits."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pooling model has no LM head: it computes no logits")


def _pooler_for(convert: str, model: Any, cfg: Any, pooler_config: PoolerConfig) -> DispatchPooler:
    if convert == "embed":
        return embedding_pooler(pooler_config, "LAST")
    if convert == "classify":
        return classification_pooler(pooler_config, model.score, model.num_labels, "LAST")
    # reward: every token's hidden state as is (vLLM: ALL pooling, no normalization, no activation by default)
    config = pooler_config if pooler_config.pooling_type in ("ALL", "STEP") else PoolerConfig(
        **{**pooler_config.model_dump(), "pooling_type": "ALL"})
    return DispatchPooler({"token_classify": Pooler.for_token_classify(config, None, 0)})


def as_pooling_model(cls: type, convert: str) -> type:
    """``cls`` (a generative family class) as a pooling model of kind ``convert``."""
    if convert not in CONVERT_TYPES:
        raise ValueError(f"convert={convert!r} is not one of {', '.join(CONVERT_TYPES)}")
    if is_pooling_model(cls):
        raise ValueError(f"{cls.__name__} is already a pooling model; convert applies to generative models")

    def __init__(self: Any, hf_config: Any, dtype: torch.dtype, pooler_config: PoolerConfig | None = None,
                 **kwargs: Any) -> None:
        cls.__init__(self, hf_config, dtype, **kwargs)  # type: ignore[misc]
        cfg = config_for(hf_config)
        head = getattr(self, "lm_head", None)
        embed = getattr(getattr(self, "model", None), "embed_tokens", None)
        tied = head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)
        self._drops_lm_head = head is not None and not tied
        if self._drops_lm_head:
            self.lm_head = _NoLMHead()
        if convert == "classify":
            self.num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
            if self.num_labels < 1:
                raise ValueError("convert='classify' needs num_labels (or id2label) in the model config")
            # small: whole on every tensor-parallel rank, which all pool the same hidden states
            self.score = ReplicatedLinear(cfg.hidden_size, self.num_labels, False, dtype)
        self.pooler = _pooler_for(convert, self, cfg, pooler_config or PoolerConfig())

    def compute_logits(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is a pooling model ({convert}); it computes no logits")

    def _checkpoint_names(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        children = {name for name, _ in self.named_children()}
        has_inner = "model" in children
        for name, tensor in weights:
            if name.startswith("lm_head.") and self._drops_lm_head:
                continue  # the converted model has no LM head
            if has_inner and name.split(".", 1)[0] not in children:
                name = f"model.{name}"  # saved from the bare decoder (Qwen2Model, LlamaModel)
            yield name, tensor

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = cls.load_weights(self, _checkpoint_names(self, weights))  # type: ignore[attr-defined]
        return loaded

    suffix = {"embed": "ForEmbedding", "classify": "ForSequenceClassification", "reward": "ForReward"}[convert]
    name = cls.__name__
    for generate_suffix in ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel"):
        if name.endswith(generate_suffix):
            name = name[: -len(generate_suffix)]
            break
    # PoolingModel: the runner pools instead of sampling, and captures no decode graphs (pooling steps are prefills)
    return type(name + suffix, (cls, PoolingModel), {
        "__init__": __init__,
        "__module__": cls.__module__,
        "__doc__": f"{cls.__name__} converted to a pooling model ({convert}) by pagoda.models.adapters.",
        "convert_type": convert,
        "compute_logits": compute_logits,
        "load_weights": load_weights,
    })


def as_embedding_model(cls: type) -> type:
    return as_pooling_model(cls, "embed")


def as_seq_cls_model(cls: type) -> type:
    return as_pooling_model(cls, "classify")


def as_reward_model(cls: type) -> type:
    return as_pooling_model(cls, "reward")
