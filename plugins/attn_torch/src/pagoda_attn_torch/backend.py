"""Paged attention in plain torch: the reference backend, and the fallback on every platform (the CPU default is cpu_paged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagoda.attention.checks import check_kv_cache, layout_reasons
from pagoda.attention.interface import AttentionBackend, AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda.attention.prefill import prefill_attention
from pagoda_attn_torch.compute import attend_batched, attend_dense, write_kv
from pagoda_attn_torch.plan import StepPlan, build_plan

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "xla")


@dataclass(kw_only=True)
class TorchPagedMetadata(AttentionMetadata):
    """The step's layout with its plan (gather indices, masks, which sequences are batched)."""

    plan: StepPlan


class TorchPagedAttentionBackend(AttentionBackend[TorchPagedMetadata]):
    """Reads K/V straight from the paged cache; mixed decode/prefill batches in one call.

    ``prepare`` plans the step once (gather indices, masks, which sequences are
    batched); each layer's ``forward`` then does only tensor work.
    """

    name: ClassVar[str] = "torch_paged"
    supports_fp8_kv_cache: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.reasons_unsupported(spec)
        if reasons:
            raise ValueError(f"torch_paged attention cannot serve {spec}: " + "; ".join(reasons))
        super().__init__(spec)

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        if spec.device_type not in SUPPORTED_DEVICE_TYPES:
            reasons.append(f"device type {spec.device_type!r} is not one of {SUPPORTED_DEVICE_TYPES}")
        return reasons + layout_reasons(spec)

    @classmethod
    def preferred_block_sizes(cls) -> tuple[int, ...]:
        return (16, 32, 64)

    def prepare(self, metadata: AttentionMetadata) -> TorchPagedMetadata:
        plan = build_plan(metadata, self.spec.block_size, causal=self.spec.causal)
        return TorchPagedMetadata.from_common(metadata, plan=plan)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchPagedMetadata,
        params: AttentionLayerParams,
    ) -> torch.Tensor:
        if not isinstance(metadata, TorchPagedMetadata):
            raise RuntimeError(
                "torch_paged attention: metadata was not prepared; call backend.prepare(metadata) once per step"
            )
        plan = metadata.plan
        check_kv_cache(kv_cache, self.spec.block_size, key)
        num_tokens, num_heads, head_dim = query.shape
        if not plan.causal:
            return self._forward_bidirectional(query, key, value, kv_cache, plan, params)
        write_kv(key, value, kv_cache, plan, params)

        groups = plan.batched
        if len(groups) == 1 and groups[0].result_index is None and not plan.looped:
            # Every row is one decode, in order: the batched result is the output.
            out = attend_batched(query, kv_cache, groups[0], 0, plan, params)
            return out.reshape(num_tokens, num_heads, head_dim)

        out = query.new_empty(num_tokens, num_heads, head_dim)
        if plan.num_real_tokens < num_tokens:
            out[plan.num_real_tokens :].zero_()
        for index, group in enumerate(groups):
            padded = attend_batched(query, kv_cache, group, index, plan, params)
            assert group.result_index is not None and group.output_rows is not None  # only the in-order case lacks them
            real = padded.reshape(-1, num_heads, head_dim).index_select(0, group.result_index)
            out.index_copy_(0, group.output_rows, real)
        for index, seq in enumerate(plan.looped):
            out[seq.row_start : seq.row_end] = prefill_attention(
                query, key, value, kv_cache, seq, index, params, plan.workspace)
        return out

    @staticmethod
    def _forward_bidirectional(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               plan: StepPlan, params: AttentionLayerParams) -> torch.Tensor:
        if plan.looped:
            # only a sequence on top of cached tokens reads the cache back
            write_kv(key, value, kv_cache, plan, params)
        # else nothing is written: a bidirectional sequence is computed whole in its step and never
        # extended, so no later step reads its K/V
        num_tokens, num_heads, head_dim = query.shape
        if not plan.looped and len(plan.dense) == 1 and plan.dense[0].num_seqs * plan.dense[0].seq_len == num_tokens:
            # one run covers the batch (equal-length prompts): its result is the output, no copy
            return attend_dense(query, key, value, kv_cache, plan.dense[0], params)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        if plan.num_real_tokens < num_tokens:
            out[plan.num_real_tokens :].zero_()
        for run in plan.dense:
            out[run.row_start : run.row_start + run.num_seqs * run.seq_len] = attend_dense(
                query, key, value, kv_cache, run, params)
        for index, seq in enumerate(plan.looped):
            # a sliding window with causal=False is refused (reasons_unsupported): the params carry none
            out[seq.row_start : seq.row_end] = prefill_attention(
                query, key, value, kv_cache, seq, index, params, plan.workspace)
        return out
