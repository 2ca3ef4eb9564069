"""Triton dequantize-matmul for GPTQ and AWQ layers on CUDA / ROCm GPUs, reading the checkpoint's own layout.

One kernel serves both formats (``AWQ`` is a compile-time switch): each program computes a
BLOCK_M x BLOCK_N tile of ``y = x w`` and, per BLOCK_K slice of the input channels, loads the
packed int32 words of that slice, shifts each value's nibble out (GPTQ: the k's position in its
word of 32 / bits rows; AWQ: the column's position in AWQ's interleaved order), subtracts the zero of
the channel's group (GPTQ: ``g_idx[k]``, act order included; AWQ: ``k // group_size``), scales, and
multiplies with ``tl.dot`` in float32 (exact IEEE products for float32
activations, TF32 for half-precision ones). Nothing is repacked at load.

Imported only where Triton is (a GPU platform, or the tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_quant_gptq_awq.formats import PackedCheckpoint


@triton.jit
def _int4_matmul(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, bias_ptr, y_ptr,
                 M, N, K, stride_xm, stride_ym, group_size,
                 AWQ: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    PACK = 32 // BITS  # constexpr arithmetic: compile-time values
    MASK = (1 << BITS) - 1
    packed_cols = N // PACK
    # the bits of column n inside its int32 (qzeros always; AWQ's qweight too; AWQ is 4-bit only)
    if AWQ:
        col_shift = ((rn % 8) // 2 + (rn % 2) * 4) * 4
    else:
        col_shift = (rn % PACK) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        kn_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + rk, mask=k_mask, other=0)
        else:
            g = rk // group_size
        if AWQ:
            words = tl.load(qweight_ptr + rk[:, None] * packed_cols + (rn // PACK)[None, :], mask=kn_mask, other=0)
            q = (words >> col_shift[None, :]) & MASK
        else:
            words = tl.load(qweight_ptr + (rk // PACK)[:, None] * N + rn[None, :], mask=kn_mask, other=0)
            q = (words >> ((rk % PACK) * BITS)[:, None]) & MASK
        zwords = tl.load(qzeros_ptr + g[:, None] * packed_cols + (rn // PACK)[None, :], mask=kn_mask, other=0)
        z = ((zwords >> col_shift[None, :]) & MASK) + ZERO_OFFSET
        s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=kn_mask, other=0.0).to(tl.float32)
        w = (q - z).to(tl.float32) * s
        # float32 operands: half-precision activations are exact in TF32, whose 10-bit mantissa also keeps
        # the weights closer than a cast to the activations' dtype would (and the interpreter's bf16 dot is wrong)
        acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def matmul(x: torch.Tensor, ckpt: PackedCheckpoint, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] -> float32 [M, N] = x . dequantize(ckpt)^T (+ bias), on ``x``'s device."""
    m, k = x.shape
    n = ckpt.out_features
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    g_idx = ckpt.g_idx
    _int4_matmul[grid](
        x, ckpt.qweight, ckpt.qzeros, ckpt.scales, g_idx if g_idx is not None else ckpt.qweight,
        bias if bias is not None else ckpt.scales, y,
        m, n, k, x.stride(0), y.stride(0), ckpt.group_size,
        AWQ=ckpt.format == "awq", BITS=ckpt.bits, ZERO_OFFSET=ckpt.zero_offset, HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
