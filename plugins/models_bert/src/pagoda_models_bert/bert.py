"""BERT-style encoders for the engine: BERT, RoBERTa, XLM-RoBERTa; embedding models and sequence classifiers.

Written for the flat token batch like the decoders: activations are
[T, hidden], attention goes through ``pagoda.attention.Attention`` with
``causal=False`` (every token sees its whole sequence; the engine pools a
prompt in one step). q/k/v are one fused projection (``qkv_proj``). Positions
are absolute embeddings; RoBERTa numbers them from ``padding_idx + 1`` as its
``create_position_ids_from_input_ids`` does for an unpadded sequence. Token
type ids come from the runner (zeros unless a prompt gives them: the second
text of a cross-encoder pair).

Tensor parallelism comes from core's layers: qkv and the intermediate dense
column-parallel (heads and the MLP width split across ranks), each output dense
row-parallel (one all-reduce), the word, position and token-type tables
vocab-parallel; the pooler and classifier heads are small and replicated, so
every rank pools the same all-reduced hidden states.

The classes are pooling models: ``forward`` returns the last hidden states and
``pooler`` (core's ``pagoda.pooling.pooler``) turns them into embeddings,
class probabilities or scores.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagoda.attention import Attention, AttentionMetadata
from pagoda.distributed import get_tensor_model_parallel_world_size
from pagoda.layers import (
    Activation,
    ColumnParallelLinear,
    LayerNorm,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagoda.models.interface import PoolingModel, SupportsTokenTypeIds
from pagoda.pooling.config import PoolerConfig
from pagoda.pooling.pooler import DispatchPooler, classification_pooler, embedding_pooler
from pagoda_models_bert.weights import load_bert_weights


def _check_config(cfg: Any) -> None:
    kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} is not supported by the BERT family (only 'absolute')")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise ValueError("BERT-family decoders (is_decoder / add_cross_attention) are not supported: only encoders")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.position_embeddings = VocabParallelEmbedding(cfg.max_position_embeddings, cfg.hidden_size, dtype)
        self.token_type_embeddings = VocabParallelEmbedding(cfg.type_vocab_size, cfg.hidden_size, dtype)
        # with the table split across ranks, row 0 is one rank's: look it up (and all-reduce) like any id
        self.whole_token_types = get_tensor_model_parallel_world_size() == 1
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        # RoBERTa: position p of a sequence reads row p + padding_idx + 1
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset if self.position_offset else positions)
        if token_type_ids is None and self.whole_token_types:
            hidden = hidden + self.token_type_embeddings.weight[0]
        elif token_type_ids is None:
            hidden = hidden + self.token_type_embeddings(torch.zeros_like(input_ids))
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        if cfg.hidden_size % total_heads:
            raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={total_heads}")
        self.head_dim = cfg.hidden_size // total_heads
        # query, key and value stacked into one matmul; with tensor parallelism this rank's heads only
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_heads, True, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.size = self.num_heads * self.head_dim
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, layer_idx=layer_idx, causal=False)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split(self.size, dim=-1)
        return self.attn(q, k, v, metadata)


class BertDenseAndNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's attention output and layer output (``…output``)."""

    def __init__(self, in_features: int, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, cfg.hidden_size, True, dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # in place into the matmul's fresh output: one large buffer fewer per call (page faults on CPU)
        out = self.dense(x)
        out += residual
        return self.LayerNorm(out)


class BertAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, layer_idx, dtype)
        self.output = BertDenseAndNorm(cfg.hidden_size, cfg, dtype)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, metadata), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.act = Activation(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.dense(hidden)
        if self.act.name == "gelu" and not out.requires_grad:
            # in place on the matmul's fresh output (the same erf GELU as F.gelu)
            return torch.ops.aten.gelu_(out)
        return self.act(out)


class BertLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, layer_idx, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = BertDenseAndNorm(cfg.intermediate_size, cfg, dtype)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, metadata)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, metadata)
        return hidden


class BertPooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h))`` of the [CLS] row (the classifier's input)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, True, dtype)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertTrunk(nn.Module):
    """Embeddings + encoder (transformers' ``BertModel`` without its head), under HF parameter names."""

    def __init__(self, cfg: Any, dtype: torch.dtype, position_offset: int, with_pooler: bool) -> None:
        super().__init__()
        _check_config(cfg)
        self.embeddings = BertEmbeddings(cfg, dtype, position_offset)
        self.encoder = BertEncoder(cfg, dtype)
        self.pooler = BertPooler(cfg, dtype) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), metadata)


class _BertPoolingModel(nn.Module, PoolingModel, SupportsTokenTypeIds):
    """What every class here shares: the trunk under ``prefix``, forward, weight loading.

    SupportsTokenTypeIds: the runner keeps token type ids per row and passes them to forward.
    """

    # transformers' attribute name of the trunk in the *ForSequenceClassification checkpoints
    prefix = "bert"
    position_offset_from_padding = False
    # checkpoint weights that name nothing this class computes (skipped, not an error)
    ignored_prefixes: tuple[str, ...] = ()

    def __init__(self, hf_config: Any, dtype: torch.dtype, pooler_config: PoolerConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        offset = 0
        if self.position_offset_from_padding:
            offset = int(getattr(hf_config, "pad_token_id", 1) or 0) + 1
        setattr(self, self.prefix, BertTrunk(hf_config, dtype, offset, with_pooler=self._trunk_pooler()))
        self.pooler_config = pooler_config or PoolerConfig()

    def _trunk_pooler(self) -> bool:
        return False

    @property
    def trunk(self) -> BertTrunk:
        trunk: BertTrunk = getattr(self, self.prefix)
        return trunk

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.trunk(input_ids, positions, metadata, token_type_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, self.prefix, self.ignored_prefixes)


class BertModel(_BertPoolingModel):
    """An embedding model (sentence-transformers' BERTs): CLS pooling unless its pooler config says otherwise."""

    default_pooling_type = "CLS"
    # the checkpoint's pooler.dense serves BertForSequenceClassification's head, not embeddings (vLLM skips it too)
    ignored_prefixes = ("pooler.",)

    def __init__(self, hf_config: Any, dtype: torch.dtype, pooler_config: PoolerConfig | None = None) -> None:
        super().__init__(hf_config, dtype, pooler_config)
        self.pooler: DispatchPooler = embedding_pooler(self.pooler_config, self.default_pooling_type)


class BertForSequenceClassification(_BertPoolingModel):
    """[CLS] -> BERT's pooler (dense + tanh) -> classifier; cross-encoders score pairs with token type ids."""

    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, dtype: torch.dtype, pooler_config: PoolerConfig | None = None) -> None:
        super().__init__(hf_config, dtype, pooler_config)
        self.num_labels = int(hf_config.num_labels)
        self.classifier = ReplicatedLinear(hf_config.hidden_size, self.num_labels, True, dtype)
        self.pooler: DispatchPooler = classification_pooler(
            self.pooler_config, self._classify, self.num_labels, self.default_pooling_type, per_token=self.classifier)

    def _trunk_pooler(self) -> bool:
        return True

    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        assert self.trunk.pooler is not None
        return self.classifier(self.trunk.pooler(pooled))


class RobertaClassificationHead(nn.Module):
    """``out_proj(tanh(dense(h)))`` (transformers' RobertaClassificationHead, dropout off)."""

    def __init__(self, cfg: Any, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.out_proj = ReplicatedLinear(cfg.hidden_size, num_labels, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaModel(BertModel):
    prefix = "roberta"
    position_offset_from_padding = True


class RobertaForSequenceClassification(_BertPoolingModel):
    default_pooling_type = "CLS"
    prefix = "roberta"
    position_offset_from_padding = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, pooler_config: PoolerConfig | None = None) -> None:
        super().__init__(hf_config, dtype, pooler_config)
        self.num_labels = int(hf_config.num_labels)
        self.classifier = RobertaClassificationHead(hf_config, self.num_labels, dtype)
        self.pooler: DispatchPooler = classification_pooler(
            self.pooler_config, self.classifier, self.num_labels, self.default_pooling_type)


class XLMRobertaModel(RobertaModel):
    pass


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
