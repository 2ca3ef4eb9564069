"""Paged attention on pagoda-kernels' Triton kernels (CUDA and ROCm GPUs).

Per layer: write the step's K/V into the paged cache by slot, then attend. A
step of only decodes runs the split-K decode kernel; a step with any prefill
(chunk) runs the varlen kernel, where decodes are one-row query tiles.

The all-decode path is CUDA-graph safe (``supports_cuda_graphs``): ``prepare``
decides the split-K fan-out from host ints only, and ``forward`` launches a
grid fixed by the batch size and that fan-out. Under a graph the runner
prepares with ``max_seq_len = max_model_len``, so the fan-out suits the
longest context; the kernel reads each row's real length from ``seq_lens`` on
the device, and splits past it do no work and weigh zero in the reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention import AttentionBackend, AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda.triton_utils import triton_available
from pagoda_kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Per-program tiles hold head_dim columns in registers; beyond this they spill.
MAX_HEAD_DIM = 256


@dataclass(kw_only=True)
class TritonPagedMetadata(AttentionMetadata):
    """The step's layout with the decode kernel's split-K fan-out (None: the step has a prefill)."""

    num_splits: int | None


class TritonPagedAttentionBackend(AttentionBackend[TritonPagedMetadata]):
    name = "triton_paged"
    supports_cuda_graphs = True
    # fp8 caches: quantized by the write kernel, dequantized (times k_scale / v_scale) as tiles load
    supports_fp8_kv_cache = True

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        reasons: list[str] = []
        if spec.device_type != "cuda":
            reasons.append(f"needs a CUDA/ROCm device (this engine runs on device type {spec.device_type!r})")
        if not triton_available():
            reasons.append("triton is not installed (pip install triton)")
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not one of float16, bfloat16, float32")
        if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        if spec.head_dim > MAX_HEAD_DIM:
            reasons.append(f"head_dim {spec.head_dim} is larger than {MAX_HEAD_DIM}")
        if spec.alibi_slopes is not None:
            # the kernels add no per-head positional bias; torch_paged serves ALiBi models
            reasons.append("ALiBi (alibi_slopes) is not implemented by the Triton kernels")
        if not spec.causal:
            # the kernels mask causally; torch_paged serves encoder-only (pooling) models
            reasons.append("bidirectional (causal=False) attention is not implemented by the Triton kernels")
        return reasons

    @classmethod
    def preferred_block_sizes(cls) -> tuple[int, ...]:
        return (16, 32)

    def prepare(self, metadata: AttentionMetadata) -> TritonPagedMetadata:
        # Decide the decode split-K fan-out once per step, from host ints (no device sync).
        # Graph capture calls this once per batch size with max_seq_len = max_model_len.
        splits = None
        if metadata.is_all_decode:
            from pagoda_kernels.triton_impl.decode import choose_num_splits

            splits = choose_num_splits(
                metadata.num_seqs, self.spec.num_kv_heads, metadata.max_seq_len, metadata.seq_lens.device
            )
        return TritonPagedMetadata.from_common(metadata, num_splits=splits)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonPagedMetadata,
        params: AttentionLayerParams,
    ) -> torch.Tensor:
        if not isinstance(metadata, TritonPagedMetadata):
            raise RuntimeError(
                "triton_paged attention: metadata was not prepared; call backend.prepare(metadata) once per step"
            )
        n = metadata.num_tokens
        scales = {"k_scale": params.k_scale, "v_scale": params.v_scale}
        # Rows past num_tokens are padding. (Graph replays pass num_tokens = the padded
        # size instead: their padding rows have slot -1, so nothing is written for them.)
        reshape_and_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n], impl="triton", **scales)
        if metadata.is_all_decode:
            out = paged_decode_attention(
                query[:n], kv_cache, metadata.block_tables, metadata.seq_lens, params.scale,
                params.sliding_window, params.logits_soft_cap, metadata.max_seq_len, metadata.num_splits,
                impl="triton", **scales,
            )
        else:
            out = paged_prefill_attention(
                query[:n], kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
                params.scale, params.sliding_window, params.logits_soft_cap, metadata.max_query_len, impl="triton",
                **scales,
            )
        if query.shape[0] == n:
            return out
        padded = torch.zeros_like(query)
        padded[:n] = out
        return padded
