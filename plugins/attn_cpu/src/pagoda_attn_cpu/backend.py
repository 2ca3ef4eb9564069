"""The CPU paged-attention backend: the torch_paged contract, served by one C++ kernel call per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagoda.attention.interface import AttentionBackend, AttentionMetadata, AttentionSpec
from pagoda_attn_cpu.kernel import build_failure, kernel
from pagoda_attn_torch.backend import TorchPagedAttentionBackend
from pagoda_attn_torch.compute import attend_looped
from pagoda_attn_torch.plan import LoopedSequence, StepPlan

PLAN_KEY = "cpu_paged"
# Query tokens per work item: a long prefill splits into tiles so both cores get work
# and a tile's K/V stays in cache while all its query rows pass over it.
TILE_TOKENS = 32
# Fresh prefills (nothing cached) of at least this many tokens go to torch's causal SDPA
# (a blocked GEMM flash kernel), which beats this kernel's dot-product loops there;
# everything else, and every sequence under a sliding window or soft cap, goes to the kernel.
SDPA_PREFILL_MIN_TOKENS = 128


@dataclass(frozen=True)
class CpuStep:
    """The step's metadata as the kernel reads it: host-side, contiguous, int32 (slots int64)."""

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    # Largest block id any sequence reads, checked against each layer's cache (-1: none).
    max_block_id: int
    # int32 ids of the sequences the kernel attends: all of them, or all but the SDPA prefills.
    all_seqs: torch.Tensor
    kernel_seqs: torch.Tensor
    # Long fresh prefills for torch's causal SDPA (when the layer has no window or soft cap),
    # with the per-step workspace that path needs.
    sdpa_prefills: list[LoopedSequence]
    sdpa_plan: StepPlan | None


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    """Every sequence of the step (decodes, chunks, prefills) in one OpenMP-parallel kernel call.

    Work items are (sequence, tile of up to TILE_TOKENS query tokens), each reading its blocks
    once for every KV head (split per KV head when there are too few items for the cores), so a
    batch of decodes balances over the cores and the query heads of a GQA group share each K/V read.
    """

    name: ClassVar[str] = "cpu_paged"

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.reasons_unsupported(spec)
        if reasons:
            raise ValueError(f"cpu_paged attention cannot serve {spec}: " + "; ".join(reasons))
        AttentionBackend.__init__(self, spec)
        self._kernel = kernel()

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = [r for r in super().reasons_unsupported(spec) if not r.startswith("device type")]
        if spec.device_type != "cpu":
            reasons.append(f"device type {spec.device_type!r} is not 'cpu'")
        if not reasons:
            failure = build_failure()  # compiles on first use; cached per machine afterwards
            if failure is not None:
                reasons.append(failure)
        return reasons

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        step = build_step(metadata, self.spec.block_size)
        metadata.extra = {**(metadata.extra or {}), PLAN_KEY: step}
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
    ) -> torch.Tensor:
        step = (metadata.extra or {}).get(PLAN_KEY)
        if step is None:
            raise RuntimeError(
                "cpu_paged attention: metadata was not prepared; call backend.prepare(metadata) once per step"
            )
        self._check_cache(kv_cache, key)
        if step.max_block_id >= kv_cache.shape[1]:
            raise ValueError(
                f"attention metadata: block id {step.max_block_id} is past the cache's {kv_cache.shape[1]} blocks"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window={sliding_window} must be positive")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be positive")
        cache_dtype = kv_cache.dtype
        use_sdpa = bool(step.sdpa_prefills) and sliding_window is None and logits_soft_cap is None
        q = query.to(cache_dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = self._kernel.paged_attention(
            q,
            key.to(cache_dtype),
            value.to(cache_dtype),
            kv_cache,
            step.slot_mapping,
            step.query_start,
            step.seq_lens,
            step.block_tables,
            step.kernel_seqs if use_sdpa else step.all_seqs,
            float(scale),
            int(sliding_window or 0),
            float(logits_soft_cap or 0.0),
            TILE_TOKENS,
        )
        if use_sdpa:
            assert step.sdpa_plan is not None
            # The kernel has written every new K/V; these read theirs straight from key/value.
            for index, seq in enumerate(step.sdpa_prefills):
                out[seq.row_start : seq.row_end] = attend_looped(
                    q, key, value, kv_cache, seq, index, step.sdpa_plan, scale, None, None
                )
        return out if out.dtype == query.dtype else out.to(query.dtype)


def build_step(metadata: AttentionMetadata, block_size: int) -> CpuStep:
    """Validate the batch layout once per step and put it in the form the kernel reads."""
    if metadata.block_tables.device.type != "cpu":
        raise ValueError(f"cpu_paged attention needs CPU metadata, got block_tables on {metadata.block_tables.device}")
    num_seqs = metadata.num_seqs
    query_start = _host_int32(metadata.query_start_loc_cpu, metadata.query_start_loc)
    seq_lens = _host_int32(metadata.seq_lens_cpu, metadata.seq_lens)
    if query_start.numel() != num_seqs + 1 or seq_lens.numel() != num_seqs:
        raise ValueError(
            f"attention metadata: query_start_loc has {query_start.numel()} entries and seq_lens "
            f"{seq_lens.numel()}, expected {num_seqs + 1} and {num_seqs} for num_seqs={num_seqs}"
        )
    block_tables = metadata.block_tables.to(torch.int32).contiguous()
    max_block_id = -1
    if num_seqs:
        query_lens = query_start[1:] - query_start[:-1]
        if int(query_start[0]) != 0 or int(query_lens.min()) < 0 or int((seq_lens - query_lens).min()) < 0:
            raise ValueError(
                "attention metadata: query_start_loc must start at 0 and not decrease, and seq_lens be >= query lengths"
            )
        if int(query_start[-1]) > metadata.num_tokens:
            raise ValueError(
                f"attention metadata: sequences cover {int(query_start[-1])} rows but num_tokens={metadata.num_tokens}"
            )
        blocks_needed = (seq_lens.to(torch.int64) + block_size - 1) // block_size
        widest = int(blocks_needed.max())
        if widest > block_tables.shape[1]:
            raise ValueError(
                f"attention metadata: a sequence needs {widest} blocks but block_tables has {block_tables.shape[1]} columns"
            )
        used = torch.arange(widest).unsqueeze(0) < blocks_needed.unsqueeze(1)
        used_ids = block_tables[:, :widest][used]
        if used_ids.numel():
            if int(used_ids.min()) < 0:
                raise ValueError("attention metadata: block_tables holds a negative block id for a used block")
            max_block_id = int(used_ids.max())
    slot_mapping = metadata.slot_mapping[: metadata.num_tokens].to(torch.int64).contiguous()

    query_lens = query_start[1:] - query_start[:-1]
    long_fresh = (query_lens >= SDPA_PREFILL_MIN_TOKENS) & (query_lens == seq_lens)
    sdpa_ids = torch.nonzero(long_fresh).flatten().tolist()
    sdpa_prefills = [
        LoopedSequence(
            row_start=int(query_start[i]),
            row_end=int(query_start[i + 1]),
            context_len=0,
            seq_len=int(seq_lens[i]),
            block_ids=block_tables[i, : -(-int(seq_lens[i]) // block_size)].to(torch.int64),
        )
        for i in sdpa_ids
    ]
    sdpa_plan = None
    if sdpa_prefills:
        sdpa_plan = StepPlan(
            num_tokens=metadata.num_tokens,
            num_real_tokens=int(query_start[-1]),
            write_rows=None,
            write_slots=slot_mapping,
            batched=[],
            looped=sdpa_prefills,
        )
    all_seqs = torch.arange(num_seqs, dtype=torch.int32)
    kernel_seqs = torch.nonzero(~long_fresh).flatten().to(torch.int32) if sdpa_prefills else all_seqs
    return CpuStep(
        query_start, seq_lens, block_tables, slot_mapping, max_block_id, all_seqs, kernel_seqs, sdpa_prefills, sdpa_plan
    )


def _host_int32(host: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return (host if host is not None else fallback.cpu()).to(torch.int32).contiguous()
