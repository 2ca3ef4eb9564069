"""The interface attention-backend plugins implement, and the batch layout they read.

KV cache layout (per layer, owned by the model runner):
    kv_cache: Tensor[2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[0] holds keys, kv_cache[1] values. Token ``t`` of a sequence lives in
    block ``block_table[t // block_size]`` at offset ``t % block_size``; its flat
    *slot* is ``block_id * block_size + offset``.

The batch is flat: the new tokens of every scheduled sequence are concatenated
(no padding to a rectangle), sequence ``i`` owning rows
``query_start_loc[i]:query_start_loc[i+1]``. A decode is a sequence with one new
token; a prefill (or a chunk of one) may sit on top of already cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, TypeVar

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention layers need; a backend says whether it can serve it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device_type: str
    block_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    # False: bidirectional (encoder-only models): every token of a sequence attends to all of its
    # tokens, later ones included. Such a sequence is computed in one step (no chunked prefill).
    causal: bool = True
    # ALiBi: one slope per query head; attention adds slope * (key_pos - query_pos) to each
    # head's scaled (and soft-capped) logits. None: no positional bias. The slopes themselves
    # reach ``forward`` as a tensor; here they tell a backend whether it must serve ALiBi.
    alibi_slopes: tuple[float, ...] | None = None
    # What the KV cache stores when it is not ``dtype`` (``kv_cache_dtype``: pagoda.attention.kv_quant):
    # float32 / bfloat16 / float16, or torch.float8_e4m3fn / float8_e5m2 for an fp8 cache, which
    # ``forward`` quantizes and dequantizes with the layer's ``k_scale`` / ``v_scale``. None: ``dtype``.
    kv_cache_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds."""
        return self.kv_cache_dtype if self.kv_cache_dtype is not None else self.dtype


@dataclass(frozen=True, eq=False, slots=True)
class AttentionLayerParams:
    """One attention layer's constants, built once per layer (``Attention.bind``) and passed to every
    ``forward``: the layer's half of the contract, as ``AttentionMetadata`` is the step's.

    Checked here, so a backend's per-call path reads them without checking again.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    # (Causal or bidirectional is the backend's ``spec.causal``: its ``prepare`` plans the step by it.)
    # ALiBi: [num_heads] float32 on the model's device (``spec.alibi_slopes`` set); else None
    alibi_slopes: torch.Tensor | None = None
    # An fp8 cache's per-layer scales (pagoda.attention.kv_quant): 0-d float32 tensors on the
    # cache's device whose values a step may change in place (calculate_kv_scales); else None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"attention layer: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim} must be positive with num_heads a multiple of num_kv_heads"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={self.logits_soft_cap} must be positive")
        if self.alibi_slopes is not None and self.alibi_slopes.shape != (self.num_heads,):
            raise ValueError(f"ALiBi needs one slope per head: {tuple(self.alibi_slopes.shape)} for {self.num_heads} heads")
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("an fp8 KV cache needs both k_scale and v_scale")


@dataclass
class AttentionMetadata:
    """The flat batch layout, the same for every layer of one step.

    All tensors live on the model's device. A backend's ``prepare`` returns it
    with what it precomputes once per step: an instance of the backend's own
    subclass (``from_common``), whose extra fields every layer's ``forward`` reads.
    """

    num_seqs: int
    num_tokens: int
    # [num_seqs + 1] int32: cumulative new-token counts (row offsets into the batch)
    query_start_loc: torch.Tensor
    # [num_seqs] int32: tokens in the KV cache after this step (cached + new)
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks] int32: KV block ids of each sequence (padding: 0)
    block_tables: torch.Tensor
    # [num_tokens] int64: slot each new token's K/V is written to (-1: skip)
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that plan on the CPU without syncing.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # True when every sequence has exactly one new token.
    is_all_decode: bool = False

    @classmethod
    def from_common(cls: type[M], common: AttentionMetadata, **prepared: Any) -> M:
        """``common``'s batch layout as an instance of ``cls`` (a backend's subclass) with its ``prepared`` fields.

        Runs once per step: from the runner's plain metadata it copies the instance dict (~0.8 us
        where naming the fields costs twice that); from an already prepared one, the common fields only.
        """
        values = common.__dict__ if type(common) is AttentionMetadata else {n: getattr(common, n) for n in _COMMON_FIELDS}
        return cls(**values, **prepared)

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """Tokens already cached before this step."""
        return self.seq_lens - self.query_lens


M = TypeVar("M", bound=AttentionMetadata)
_COMMON_FIELDS = tuple(f.name for f in fields(AttentionMetadata))


class AttentionBackend(Generic[M]):
    """One attention implementation, generic over the metadata its ``prepare`` builds.

    Instances are created once per engine.
    """

    name: ClassVar[str] = "base"
    # True when an all-decode step can be captured in a CUDA graph and replayed
    # (pagoda.worker.graphs). The runner then calls ``prepare`` once per capture
    # size, on metadata whose tensors are static buffers refilled before each
    # replay, with ``max_seq_len`` = max_model_len (an upper bound) and no host
    # copies; ``prepare`` and ``forward`` on it must not sync with the device,
    # read tensor values on the host, or pick shapes or kernels from the data.
    supports_cuda_graphs: ClassVar[bool] = False
    # The CPU counterpart (pagoda.cpp_extension.graph): the same contract, with ``forward``'s work done
    # by pagoda kernel-module calls (or torch ops) on the prepared metadata's tensors, whose storage
    # the backend or the metadata holds. A capture that breaks it fails and the runner stays eager.
    supports_kernel_graphs: ClassVar[bool] = False
    # vLLM's AttentionCGSupport.UNIFORM_BATCH: the graph contract above also holds for steps in which
    # every sequence has the same query length q > 1 (speculative verify steps: 1 + the drafts), on
    # metadata prepared once per (batch size, q) with ``max_query_len = q``; ``prepare`` may read the
    # static buffers' values at that one call (the capture fills them with q-row padding sequences).
    supports_uniform_batch_graphs: ClassVar[bool] = False
    # True when ``forward`` reads and writes an fp8 KV cache (spec.kv_cache_dtype float8_e4m3fn /
    # float8_e5m2) with the k_scale / v_scale it is given; the selector refuses fp8 to the others.
    supports_fp8_kv_cache: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        """Why this backend cannot serve ``spec``; an empty list means it can."""
        return []

    @classmethod
    def preferred_block_sizes(cls) -> tuple[int, ...]:
        return (16,)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, metadata: AttentionMetadata) -> M:
        """The step's metadata with what every layer reuses, precomputed once per step.

        A backend that precomputes nothing returns ``metadata`` itself (the default); one that
        does returns its own ``AttentionMetadata`` subclass (``SubClass.from_common(metadata, ...)``),
        which its ``forward`` then takes.
        """
        return metadata  # type: ignore[return-value]  # M is AttentionMetadata for a backend without its own

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: M,
        params: AttentionLayerParams,
    ) -> torch.Tensor:
        """Write the new K/V into ``kv_cache`` at ``slot_mapping``, then attend.

        ``metadata``: what ``prepare`` returned for this step; ``params``: the calling layer's constants.
        Returns [num_tokens, num_heads, head_dim]. Causal: a new token at
        absolute position p (= context_len + its index among the new tokens)
        attends to cached and new tokens at positions <= p (and > p - window
        with ``params.sliding_window``). With ``spec.causal`` False every token attends
        to all ``seq_len`` tokens of its sequence.

        ``params.alibi_slopes`` ([num_heads] float32, set only when ``spec.alibi_slopes`` is):
        head h's logit of a query at position p for a key at position j gets
        ``alibi_slopes[h] * (j - p)`` added after the scale and any soft cap.

        ``params.k_scale`` / ``v_scale`` (set only when the cache is fp8): the cache stores
        saturate(k / k_scale) and reads back fp8 * k_scale (``pagoda.attention.kv_quant``); a
        backend whose ``reasons_unsupported`` accepts an fp8 ``spec.kv_cache_dtype`` reads them.
        """
        raise NotImplementedError
