"""Paged attention in plain torch: the reference backend, and the fallback on every platform (the CPU default is cpu_paged)."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagoda.attention.interface import AttentionBackend, AttentionMetadata, AttentionSpec
from pagoda_attn_torch.compute import attend_batched, attend_dense, attend_looped, write_kv
from pagoda_attn_torch.plan import StepPlan, build_plan

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "xla")
PLAN_KEY = "torch_paged"


class TorchPagedAttentionBackend(AttentionBackend):
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
        if spec.num_heads <= 0 or spec.num_kv_heads <= 0 or spec.head_dim <= 0:
            reasons.append(
                f"num_heads={spec.num_heads}, num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim} must all be positive"
            )
        elif spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        if spec.block_size <= 0:
            reasons.append(f"block_size={spec.block_size} must be positive")
        if spec.sliding_window is not None and spec.sliding_window <= 0:
            reasons.append(f"sliding_window={spec.sliding_window} must be positive")
        if spec.logits_soft_cap is not None and spec.logits_soft_cap <= 0:
            reasons.append(f"logits_soft_cap={spec.logits_soft_cap} must be positive")
        if not spec.causal and spec.sliding_window is not None:
            reasons.append("a sliding window with bidirectional (causal=False) attention is not implemented")
        if spec.alibi_slopes is not None and len(spec.alibi_slopes) != spec.num_heads:
            reasons.append(f"{len(spec.alibi_slopes)} ALiBi slopes for {spec.num_heads} heads (one per head)")
        return reasons

    @classmethod
    def preferred_block_sizes(cls) -> tuple[int, ...]:
        return (16, 32, 64)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        plan = build_plan(metadata, self.spec.block_size, causal=self.spec.causal)
        metadata.extra = {**(metadata.extra or {}), PLAN_KEY: plan}
        return metadata

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self._plan_of(metadata)
        self._check_cache(kv_cache, key)
        num_tokens, num_heads, head_dim = query.shape
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if not plan.causal:
            return self._forward_bidirectional(query, key, value, kv_cache, plan, scale, logits_soft_cap, alibi_slopes,
                                               **scales)
        write_kv(key, value, kv_cache, plan, **scales)

        groups = plan.batched
        if len(groups) == 1 and groups[0].result_index is None and not plan.looped:
            # Every row is one decode, in order: the batched result is the output.
            out = attend_batched(query, kv_cache, groups[0], 0, plan, scale, sliding_window, logits_soft_cap,
                                 alibi_slopes, **scales)
            return out.reshape(num_tokens, num_heads, head_dim)

        out = query.new_empty(num_tokens, num_heads, head_dim)
        if plan.num_real_tokens < num_tokens:
            out[plan.num_real_tokens :].zero_()
        for index, group in enumerate(groups):
            padded = attend_batched(query, kv_cache, group, index, plan, scale, sliding_window, logits_soft_cap,
                                    alibi_slopes, **scales)
            assert group.result_index is not None and group.output_rows is not None  # only the in-order case lacks them
            real = padded.reshape(-1, num_heads, head_dim).index_select(0, group.result_index)
            out.index_copy_(0, group.output_rows, real)
        for index, seq in enumerate(plan.looped):
            out[seq.row_start : seq.row_end] = attend_looped(
                query, key, value, kv_cache, seq, index, plan, scale, sliding_window, logits_soft_cap, alibi_slopes,
                **scales)
        return out

    @staticmethod
    def _forward_bidirectional(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               plan: StepPlan, scale: float, logits_soft_cap: float | None,
                               alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if plan.looped:
            # only a sequence on top of cached tokens reads the cache back
            write_kv(key, value, kv_cache, plan, **scales)
        # else nothing is written: a bidirectional sequence is computed whole in its step and never
        # extended, so no later step reads its K/V
        num_tokens, num_heads, head_dim = query.shape
        if not plan.looped and len(plan.dense) == 1 and plan.dense[0].num_seqs * plan.dense[0].seq_len == num_tokens:
            # one run covers the batch (equal-length prompts): its result is the output, no copy
            return attend_dense(query, key, value, kv_cache, plan.dense[0], scale, logits_soft_cap, **scales)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        if plan.num_real_tokens < num_tokens:
            out[plan.num_real_tokens :].zero_()
        for run in plan.dense:
            out[run.row_start : run.row_start + run.num_seqs * run.seq_len] = attend_dense(
                query, key, value, kv_cache, run, scale, logits_soft_cap, alibi_slopes, **scales)
        for index, seq in enumerate(plan.looped):
            out[seq.row_start : seq.row_end] = attend_looped(
                query, key, value, kv_cache, seq, index, plan, scale, None, logits_soft_cap, alibi_slopes, **scales)
        return out

    @staticmethod
    def _plan_of(metadata: AttentionMetadata) -> StepPlan:
        plan = (metadata.extra or {}).get(PLAN_KEY)
        if plan is None:
            raise RuntimeError(
                "torch_paged attention: metadata was not prepared; call backend.prepare(metadata) once per step"
            )
        return plan

    def _check_cache(self, kv_cache: torch.Tensor, key: torch.Tensor) -> None:
        expected = (2, self.spec.block_size, key.shape[1], key.shape[2])
        actual = (
            (kv_cache.shape[0], kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4])
            if kv_cache.dim() == 5
            else None
        )
        if actual != expected:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} does not match [2, num_blocks, {self.spec.block_size}, "
                f"{key.shape[1]}, {key.shape[2]}]"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous: new K/V are written through a flat slot view")
