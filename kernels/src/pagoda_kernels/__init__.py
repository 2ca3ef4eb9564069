"""pagoda's kernels: Triton on GPUs, each beside a plain-torch reference with the same signature.

Every public function takes ``impl="auto"|"triton"|"torch"`` (see
``pagoda_kernels.dispatch``). Importing this package imports neither triton nor
the custom ops; ``import pagoda_kernels.ops`` registers ``torch.ops.pagoda_kernels.*``.
"""

from pagoda_kernels.activation import silu_and_mul, silu_and_mul_torch
from pagoda_kernels.attention import paged_decode_attention, paged_prefill_attention
from pagoda_kernels.attention_reference import paged_decode_attention_torch, paged_prefill_attention_torch
from pagoda_kernels.dispatch import IMPL_ENV, KernelUnavailableError, interpret_mode, triton_available, use_triton
from pagoda_kernels.kv_cache import reshape_and_cache, reshape_and_cache_torch
from pagoda_kernels.norm import fused_add_rms_norm, fused_add_rms_norm_torch, rms_norm, rms_norm_torch
from pagoda_kernels.rotary import rotary_embedding, rotary_embedding_torch

__all__ = [
    "IMPL_ENV",
    "KernelUnavailableError",
    "fused_add_rms_norm",
    "fused_add_rms_norm_torch",
    "interpret_mode",
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "reshape_and_cache",
    "reshape_and_cache_torch",
    "rms_norm",
    "rms_norm_torch",
    "rotary_embedding",
    "rotary_embedding_torch",
    "silu_and_mul",
    "silu_and_mul_torch",
    "triton_available",
    "use_triton",
]
