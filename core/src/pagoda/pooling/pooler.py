"""Poolers: the step's hidden states -> one tensor per finished pooling request (vLLM's semantics).

The runner hands a pooler the flat ``[T, hidden]`` batch and a
``PoolingMetadata`` naming each finished request's rows and parameters. A
pooler is a pooling method (which rows: CLS, MEAN, LAST, ALL, STEP) followed
by a head (what to do with them: normalize / matryoshka slice for embeddings,
a classifier and softmax / sigmoid for classification). Results are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.pooling.config import POOLING_TYPES, PoolerConfig

# hidden [N, H] -> logits [N, num_labels]
Classifier = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PoolingMetadata:
    """The finished requests of one step, in batch order.

    ``starts`` / ``lengths`` are each request's rows in the hidden states (its
    whole prompt: pooling requests are never chunked); ``prompt_token_ids``
    are given to poolers that read tokens (STEP).
    """

    starts: list[int]
    lengths: list[int]
    pooling_params: list[Any]  # pagoda.pooling_params.PoolingParams, verified (task set)
    prompt_token_ids: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def select(self, indices: Sequence[int]) -> PoolingMetadata:
        tokens = self.prompt_token_ids
        return PoolingMetadata(
            [self.starts[i] for i in indices], [self.lengths[i] for i in indices],
            [self.pooling_params[i] for i in indices], [tokens[i] for i in indices] if tokens is not None else None,
        )


# -- pooling methods: which rows ---------------------------------------------------------------------------


def _first_rows(hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
    index = torch.tensor(md.starts, dtype=torch.long, device=hidden.device)
    return hidden.index_select(0, index)


def _last_rows(hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
    index = torch.tensor([s + n - 1 for s, n in zip(md.starts, md.lengths)], dtype=torch.long, device=hidden.device)
    return hidden.index_select(0, index)


def _mean_rows(hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
    # one reduction per request (not a running sum over the batch), so a prompt pools to the same
    # value alone or in a batch; in float32 as sentence-transformers' mean pooling of a float32 model
    return torch.stack([hidden[s : s + n].float().mean(dim=0) for s, n in zip(md.starts, md.lengths)])


def pool_rows(pooling_type: str, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor | list[torch.Tensor]:
    """One vector per request (CLS, MEAN, LAST) or one [n, H] block per request (ALL, STEP)."""
    if pooling_type == "CLS":
        return _first_rows(hidden, md)
    if pooling_type == "LAST":
        return _last_rows(hidden, md)
    if pooling_type == "MEAN":
        return _mean_rows(hidden, md)
    if pooling_type in ("ALL", "STEP"):
        return [hidden[s : s + n] for s, n in zip(md.starts, md.lengths)]
    raise ValueError(f"pooling_type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")


# -- heads -------------------------------------------------------------------------------------------------


def classifier_activation(num_labels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's default: sigmoid for one label (a score), softmax over several."""
    if num_labels == 1:
        return torch.sigmoid
    return lambda x: torch.softmax(x, dim=-1)


def _embed_head(vectors: torch.Tensor, params: Any) -> torch.Tensor:
    out = vectors.float()
    if params.dimensions is not None:
        if params.dimensions > out.shape[-1]:
            raise ValueError(f"dimensions={params.dimensions} is more than the model's {out.shape[-1]}")
        out = out[..., : params.dimensions]
    if params.normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out


def _step_select(block: torch.Tensor, tokens: torch.Tensor | None, params: Any, config: PoolerConfig) -> torch.Tensor:
    returned = params.returned_token_ids or config.returned_token_ids
    if returned:
        block = block[:, returned]
    step_tag = params.step_tag_id if params.step_tag_id is not None else config.step_tag_id
    if step_tag is not None:
        if tokens is None:
            raise RuntimeError("STEP pooling with step_tag_id needs the prompt's token ids")
        block = block[tokens.to(block.device) == step_tag]
    return block


class Pooler(nn.Module):
    """Base of the poolers: ``forward(hidden, metadata) -> [one float32 tensor per request]``."""

    def get_supported_tasks(self) -> set[str]:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        raise NotImplementedError

    # vLLM's constructors --------------------------------------------------------------------------------
    @staticmethod
    def for_embed(pooler_config: PoolerConfig, default_pooling_type: str = "LAST") -> EmbeddingPooler:
        return EmbeddingPooler(pooler_config.pooling_type or default_pooling_type, pooler_config)

    @staticmethod
    def for_token_embed(pooler_config: PoolerConfig) -> EmbeddingPooler:
        pooling = pooler_config.pooling_type if pooler_config.pooling_type in ("ALL", "STEP") else "ALL"
        return EmbeddingPooler(pooling, pooler_config, token_level=True)

    @staticmethod
    def for_classify(pooler_config: PoolerConfig, classifier: Classifier | None, num_labels: int,
                     default_pooling_type: str = "LAST") -> ClassifierPooler:
        return ClassifierPooler(pooler_config.pooling_type or default_pooling_type, pooler_config, classifier, num_labels)

    @staticmethod
    def for_token_classify(pooler_config: PoolerConfig, classifier: Classifier | None, num_labels: int) -> ClassifierPooler:
        pooling = pooler_config.pooling_type if pooler_config.pooling_type in ("ALL", "STEP") else "ALL"
        return ClassifierPooler(pooling, pooler_config, classifier, num_labels, token_level=True)


class EmbeddingPooler(Pooler):
    """embed (one vector per prompt) or token_embed (one per token): matryoshka slice, then L2 norm."""

    def __init__(self, pooling_type: str, config: PoolerConfig, token_level: bool = False) -> None:
        super().__init__()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
        if not token_level and pooling_type in ("ALL", "STEP"):
            raise ValueError(f"pooling_type {pooling_type} gives one vector per token: it serves token_embed / "
                             "encode, not embed")
        self.pooling_type = pooling_type
        self.config = config
        self.token_level = token_level

    def get_supported_tasks(self) -> set[str]:
        return {"token_embed"} if self.token_level else {"embed"}

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        pooled = pool_rows(self.pooling_type, hidden_states, metadata)
        out = []
        for i, params in enumerate(metadata.pooling_params):
            data = pooled[i]
            if self.pooling_type == "STEP":
                tokens = metadata.prompt_token_ids[i] if metadata.prompt_token_ids is not None else None
                data = _step_select(data, tokens, params, self.config)
            out.append(_embed_head(data, params))
        return out


class ClassifierPooler(Pooler):
    """classify / score (one row of logits per prompt) or token_classify (per token).

    ``classifier`` maps pooled hidden states to logits (a BERT pooler + classifier,
    a converted decoder's score head); None keeps the hidden states (vLLM's
    reward conversion). Then ``logit_bias`` is subtracted and, with
    ``use_activation``, sigmoid (one label) or softmax is applied.
    """

    def __init__(self, pooling_type: str, config: PoolerConfig, classifier: Classifier | None, num_labels: int,
                 token_level: bool = False) -> None:
        super().__init__()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
        if not token_level and pooling_type in ("ALL", "STEP"):
            raise ValueError(f"pooling_type {pooling_type} gives one vector per token: it serves token_classify / "
                             "encode, not classify")
        self.pooling_type = pooling_type
        self.config = config
        # a plain attribute, not a submodule: the classifier's weights belong to the model (loaded and
        # prepared under its own names), the pooler only calls it
        object.__setattr__(self, "classifier", classifier)
        self.num_labels = num_labels
        self.token_level = token_level

    def get_supported_tasks(self) -> set[str]:
        if self.token_level:
            return {"token_classify"}
        # a pair scores as one number: only a one-label classifier is a cross-encoder
        return {"classify", "score"} if self.num_labels == 1 else {"classify"}

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        classifier: Classifier | None = self.classifier  # type: ignore[assignment]  # a plain attribute
        logits = (classifier(x) if classifier is not None else x).float()
        if self.config.logit_bias is not None:
            logits = logits - self.config.logit_bias
        return logits

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        pooled = pool_rows(self.pooling_type, hidden_states, metadata)
        params_list = metadata.pooling_params
        if isinstance(pooled, torch.Tensor):
            # one classifier call for the whole step
            logits = self._logits(pooled.to(hidden_states.dtype))
            rows = list(logits.unbind(0))
        else:
            rows = []
            for i, block in enumerate(pooled):
                logits = self._logits(block)
                if self.pooling_type == "STEP":
                    tokens = metadata.prompt_token_ids[i] if metadata.prompt_token_ids is not None else None
                    logits = _step_select(logits, tokens, params_list[i], self.config)
                rows.append(logits)
        out = []
        for logits, params in zip(rows, params_list):
            if params.use_activation:
                logits = classifier_activation(logits.shape[-1])(logits)
            out.append(logits)
        return out


class DispatchPooler(Pooler):
    """One pooler per task (vLLM's ``DispatchPooler``): each request goes to its task's pooler."""

    def __init__(self, poolers_by_task: Mapping[str, Pooler]) -> None:
        super().__init__()
        for task, pooler in poolers_by_task.items():
            if task not in pooler.get_supported_tasks():
                raise ValueError(f"the pooler given for task {task!r} serves {sorted(pooler.get_supported_tasks())}")
        self.poolers_by_task = nn.ModuleDict(dict(poolers_by_task))

    def get_supported_tasks(self) -> set[str]:
        return set(self.poolers_by_task.keys())

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        by_task: dict[str, list[int]] = {}
        for i, params in enumerate(metadata.pooling_params):
            by_task.setdefault(params.task, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(metadata)
        for task, indices in by_task.items():
            if task not in self.poolers_by_task:
                raise ValueError(f"pooling task {task!r} is not supported by this model "
                                 f"(it supports {', '.join(sorted(self.get_supported_tasks()))})")
            results = self.poolers_by_task[task](hidden_states, metadata.select(indices))
            for i, r in zip(indices, results):
                out[i] = r
        return out  # type: ignore[return-value]


def _per_token_only(pooler_config: PoolerConfig) -> bool:
    return pooler_config.pooling_type in ("ALL", "STEP")


def embedding_pooler(pooler_config: PoolerConfig, default_pooling_type: str) -> DispatchPooler:
    """An embedding model's pooler: embed and token_embed (token_embed only under ALL / STEP pooling)."""
    poolers: dict[str, Pooler] = {}
    if not _per_token_only(pooler_config):
        poolers["embed"] = Pooler.for_embed(pooler_config, default_pooling_type)
    poolers["token_embed"] = Pooler.for_token_embed(pooler_config)
    return DispatchPooler(poolers)


def classification_pooler(pooler_config: PoolerConfig, classifier: Classifier | None, num_labels: int,
                          default_pooling_type: str, per_token: Classifier | None = None) -> DispatchPooler:
    """A sequence classifier's pooler: classify (+ score for one label) and token_classify.

    ``per_token`` is the classifier applied to every token's state (default:
    ``classifier``); BERT's head, whose dense + tanh belongs to the CLS row,
    passes its bare classifier here as vLLM does. Under ALL / STEP pooling
    only token_classify is served.
    """
    poolers: dict[str, Pooler] = {}
    if not _per_token_only(pooler_config):
        poolers["classify"] = Pooler.for_classify(pooler_config, classifier, num_labels, default_pooling_type)
        if num_labels == 1:
            poolers["score"] = Pooler.for_classify(pooler_config, classifier, num_labels, default_pooling_type)
    poolers["token_classify"] = Pooler.for_token_classify(pooler_config, per_token or classifier, num_labels)
    return DispatchPooler(poolers)
