"""The CPU paged-attention backend: one C++ kernel call per layer (long fresh prefills: torch's causal SDPA)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from pagoda.attention.checks import check_kv_cache, layout_reasons
from pagoda.attention.interface import AttentionBackend, AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda.attention.kv_quant import is_fp8
from pagoda.attention.prefill import PrefillSequence, prefill_attention
from pagoda.attention.workspace import Workspace
from pagoda_attn_cpu.kernel import (
    SUPPORTED_DTYPES,
    PagedAttentionKernel,
    StepMetadata,
    build_failure,
    extension,
    kernel,
    step_metadata,
)

logger = logging.getLogger(__name__)

# Query tokens per work item: a long prefill splits into tiles so both cores get work
# and a tile's K/V stays in cache while all its query rows pass over it.
TILE_TOKENS = 32
# Fresh prefills (nothing cached) of at least this many tokens go to torch's causal SDPA
# (a blocked GEMM flash kernel); everything else, and every sequence under a sliding window
# or soft cap, goes to the kernel. Measured on SmolLM2 (9/3 heads, d=64), 2 Zen4 cores: the
# kernel is ~2x faster at 128-512 tokens (no per-sequence call, no GQA expansion), even at
# ~1,400, and SDPA ~15-20% faster from 2,048 on (its GEMM tiles win once the square term rules).
SDPA_PREFILL_MIN_TOKENS = 1536


@dataclass(frozen=True)
class CpuStep:
    """The step's metadata as the kernel reads it: host-side, contiguous, int32 (slots int64)."""

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    # int32 ids of the sequences the kernel attends: all of them, or all but the SDPA prefills.
    all_seqs: torch.Tensor
    kernel_seqs: torch.Tensor
    # Long fresh prefills for torch's causal SDPA (when the layer has no window or soft cap),
    # with the per-step workspace that path needs (None without them).
    sdpa_prefills: list[PrefillSequence]
    sdpa_workspace: Workspace | None
    # The tensors above as the kernel reads them (checked once per step, reused by every layer).
    all_seqs_args: StepMetadata
    kernel_seqs_args: StepMetadata


@dataclass(kw_only=True)
class CpuPagedMetadata(AttentionMetadata):
    """The step's layout with its kernel-side form, checked once for every layer."""

    step: CpuStep


class CpuPagedAttentionBackend(AttentionBackend[CpuPagedMetadata]):
    """Every sequence of the step (decodes, chunks, prefills) in one OpenMP-parallel kernel call.

    Work items are (sequence, tile of up to TILE_TOKENS query tokens), each reading its blocks
    once for every KV head, so a batch of decodes balances over the cores and the query heads of
    a GQA group share each K/V read. With too few items for the cores, tiles split per KV head and
    a long decode splits its keys over the threads; a tiny batch stays on the calling thread.
    """

    name: ClassVar[str] = "cpu_paged"
    # fp8 caches: written quantized and read with in-register conversion by the C++ kernel
    supports_fp8_kv_cache: ClassVar[bool] = True
    # All-decode steps: one kernel call per layer on the prepared step's tensors (views of the
    # graph runner's static buffers), no host reads of their values.
    supports_kernel_graphs: ClassVar[bool] = True
    # Verify steps (q rows a sequence) too: the kernel reads query_start / seq_lens / block tables
    # through their pointers on every call; the one host decision (SDPA for a whole-sequence prefill of
    # SDPA_PREFILL_MIN_TOKENS or more) is made at prepare, where the capture's padding never takes it.
    supports_uniform_batch_graphs: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.reasons_unsupported(spec)
        if reasons:
            raise ValueError(f"cpu_paged attention cannot serve {spec}: " + "; ".join(reasons))
        super().__init__(spec)
        self._fp8 = spec.cache_dtype if is_fp8(spec.cache_dtype) else None
        self._kernel = kernel(spec.dtype, spec.head_dim, self._fp8)
        logger.info("cpu_paged attention: C++ kernel %s (%s, head_dim %d, cache %s)",
                    extension(spec.dtype, spec.head_dim, self._fp8).name, spec.dtype, spec.head_dim, spec.cache_dtype)

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        reasons += layout_reasons(spec)
        if spec.device_type != "cpu":
            reasons.append(f"device type {spec.device_type!r} is not 'cpu'")
        if not spec.causal:
            # the kernel masks causally; torch_paged serves encoder-only models
            reasons.append("bidirectional (causal=False) attention is not implemented by the C++ kernel")
        if spec.alibi_slopes is not None:
            # the kernel's online softmax takes no per-head positional bias; torch_paged serves ALiBi models
            reasons.append("ALiBi (alibi_slopes) is not implemented by the C++ kernel")
        if not reasons:
            fp8 = spec.cache_dtype if is_fp8(spec.cache_dtype) else None
            failure = build_failure(spec.dtype, spec.head_dim, fp8)  # compiles on first use; cached per machine afterwards
            if failure is not None:
                reasons.append(failure)
        return reasons

    @classmethod
    def preferred_block_sizes(cls) -> tuple[int, ...]:
        return (16, 32, 64)

    def prepare(self, metadata: AttentionMetadata) -> CpuPagedMetadata:
        return CpuPagedMetadata.from_common(metadata, step=build_step(metadata, self.spec.block_size))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuPagedMetadata,
        params: AttentionLayerParams,
    ) -> torch.Tensor:
        if not isinstance(metadata, CpuPagedMetadata):
            raise RuntimeError(
                "cpu_paged attention: metadata was not prepared; call backend.prepare(metadata) once per step"
            )
        step = metadata.step
        # Per layer only what can differ between layers, cheaply: the kernel checks the cache's
        # contiguity and head layout against key, and every block id it reads against the cache.
        # (The params' window and soft cap were checked when the layer built them.)
        cache_shape = kv_cache.shape
        if len(cache_shape) != 5 or cache_shape[0] != 2 or cache_shape[2] != self.spec.block_size:
            check_kv_cache(kv_cache, self.spec.block_size, key)
        sliding_window, logits_soft_cap = params.sliding_window, params.logits_soft_cap
        cache_dtype = kv_cache.dtype
        use_sdpa = bool(step.sdpa_prefills) and sliding_window is None and logits_soft_cap is None
        if self._fp8 is not None and cache_dtype == self._fp8:
            return self._forward_fp8(query, key, value, kv_cache, step, params, use_sdpa)
        # The model's activations are normally in the cache dtype already: no casts then.
        q = query if query.dtype == cache_dtype else query.to(cache_dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        attend = self._kernel if cache_dtype == self._kernel.dtype else self._kernel_for(cache_dtype)
        out = attend.attend(
            q,
            key if key.dtype == cache_dtype else key.to(cache_dtype),
            value if value.dtype == cache_dtype else value.to(cache_dtype),
            kv_cache,
            step.kernel_seqs_args if use_sdpa else step.all_seqs_args,
            float(params.scale),
            int(sliding_window or 0),
            float(logits_soft_cap or 0.0),
            TILE_TOKENS,
        )
        if use_sdpa:
            assert step.sdpa_workspace is not None
            # The kernel has written every new K/V; these read theirs straight from key/value.
            for index, seq in enumerate(step.sdpa_prefills):
                out[seq.row_start : seq.row_end] = prefill_attention(
                    q, key, value, kv_cache, seq, index, params, step.sdpa_workspace
                )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _forward_fp8(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     step: CpuStep, params: AttentionLayerParams, use_sdpa: bool) -> torch.Tensor:
        """An fp8 cache: queries, keys and values stay in the model dtype; the kernel quantizes and dequantizes."""
        k_scale, v_scale = params.k_scale, params.v_scale
        if k_scale is None or v_scale is None:
            raise ValueError(f"an fp8 KV cache ({kv_cache.dtype}) needs the layer's k_scale and v_scale")
        q = query if query.stride(-1) == 1 else query.contiguous()
        dtype = self._kernel.dtype
        out = self._kernel.attend(
            q if q.dtype == dtype else q.to(dtype),
            key if key.dtype == dtype else key.to(dtype),
            value if value.dtype == dtype else value.to(dtype),
            kv_cache,
            step.kernel_seqs_args if use_sdpa else step.all_seqs_args,
            float(params.scale),
            int(params.sliding_window or 0),
            float(params.logits_soft_cap or 0.0),
            TILE_TOKENS,
            _scale_value(k_scale),
            _scale_value(v_scale),
        )
        if use_sdpa:
            assert step.sdpa_workspace is not None
            # read back from the cache (dequantized), as every other token's attention sees it
            for index, seq in enumerate(step.sdpa_prefills):
                out[seq.row_start : seq.row_end] = prefill_attention(
                    q, key, value, kv_cache, seq, index, params, step.sdpa_workspace
                )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _kernel_for(self, cache_dtype: torch.dtype) -> PagedAttentionKernel:
        """A cache in another dtype than the model's (cache_dtype set): that dtype's kernel, built on first use."""
        return kernel(cache_dtype, self.spec.head_dim)


def _scale_value(scale: torch.Tensor) -> float:
    """A 0-d scale's value, read on the host only when it changed since the last read.

    The scales change at load or in the first step (calculate_kv_scales), never in a decode step:
    a kernel graph captured at a decode step then bakes in the current value without a host read
    (which would fail the capture).
    """
    try:
        version = scale._version
    except RuntimeError:  # an inference tensor keeps no version counter: read it every time
        return float(scale)
    cached = getattr(scale, "_pagoda_scale", None)
    if cached is None or cached[0] != version:
        cached = (version, float(scale))
        scale._pagoda_scale = cached  # type: ignore[attr-defined]
    return cached[1]


def build_step(metadata: AttentionMetadata, block_size: int) -> CpuStep:
    """Put the batch layout in the form the kernel reads, checking it once per step.

    The checks run on plain lists (a handful of torch or numpy ops would cost more than a small
    batch's attention in a layer). Block ids are left to the kernel, which checks every id it
    reads against each layer's cache on every call.
    """
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
    block_tables = _int32(metadata.block_tables)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    if num_seqs:
        if starts[0] != 0 or min(query_lens) < 0 or any(n < q for n, q in zip(lens, query_lens)):
            raise ValueError(
                "attention metadata: query_start_loc must start at 0 and not decrease, and seq_lens be >= query lengths"
            )
        if starts[-1] > metadata.num_tokens:
            raise ValueError(
                f"attention metadata: sequences cover {starts[-1]} rows but num_tokens={metadata.num_tokens}"
            )
    slot_mapping = metadata.slot_mapping[: metadata.num_tokens]
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.to(torch.int64).contiguous()

    all_seqs = _seq_ids(num_seqs)
    all_args = step_metadata(slot_mapping, query_start, seq_lens, block_tables, all_seqs)
    sdpa_ids = [i for i, (q, n) in enumerate(zip(query_lens, lens)) if q >= SDPA_PREFILL_MIN_TOKENS and q == n]
    if not sdpa_ids:
        return CpuStep(query_start, seq_lens, block_tables, slot_mapping, all_seqs, all_seqs, [], None, all_args, all_args)
    sdpa_prefills = [
        PrefillSequence(
            row_start=starts[i],
            row_end=starts[i + 1],
            context_len=0,
            seq_len=lens[i],
            block_ids=block_tables[i, : -(-lens[i] // block_size)].to(torch.int64),
        )
        for i in sdpa_ids
    ]
    sdpa = set(sdpa_ids)
    kernel_seqs = torch.tensor([i for i in range(num_seqs) if i not in sdpa], dtype=torch.int32)
    kernel_args = step_metadata(slot_mapping, query_start, seq_lens, block_tables, kernel_seqs)
    return CpuStep(
        query_start, seq_lens, block_tables, slot_mapping, all_seqs, kernel_seqs, sdpa_prefills, Workspace(), all_args,
        kernel_args,
    )


@functools.lru_cache(maxsize=256)
def _seq_ids(num_seqs: int) -> torch.Tensor:
    """0 .. num_seqs - 1 as int32, made once per batch size (the kernel only reads it)."""
    return torch.arange(num_seqs, dtype=torch.int32)


def _host_int32(host: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return _int32(host if host is not None else fallback.cpu())


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous int32 tensor: the same one when it is already (the usual case), else a copy."""
    if tensor.dtype == torch.int32 and tensor.is_contiguous():
        return tensor
    return tensor.to(torch.int32).contiguous()
