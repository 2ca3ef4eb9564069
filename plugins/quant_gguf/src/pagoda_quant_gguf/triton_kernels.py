"""Triton dequantize-matmul on GGUF blocks: the CUDA / ROCm path of the ``gguf`` method.

One program computes a [BLOCK_M, BLOCK_N] tile of ``x @ W.T``: it walks the row's GGML blocks,
decodes each one's bytes (fp16 scales, nibbles, fifth bits, K-quant sub-scales) into a
[BLOCK_N, QK] float tile in registers and multiplies it with the matching slice of ``x``, so the
weight stays in its GGUF form in memory and is read once per M tile. The layouts are ggml's, the
same ones ``dequant`` reads in torch (the reference these kernels are tested against, under
``TRITON_INTERPRET=1`` on machines without a GPU).

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-value blocks) and the K-quants Q2_K .. Q6_K (256-value
super-blocks): every block type ``dequant`` serves.
Imported only where it runs: ``triton`` is not a dependency of a CPU install.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from pagoda_quant_gguf.dequant import block_size
from pagoda_quant_gguf.triton_path import TRITON_TYPES

# the constexpr code ``_decode`` branches on, per GGML type
_CODES = {int(Q.Q4_0): 0, int(Q.Q4_1): 1, int(Q.Q5_0): 2, int(Q.Q5_1): 3, int(Q.Q8_0): 4,
          int(Q.Q4_K): 5, int(Q.Q6_K): 6, int(Q.Q2_K): 7, int(Q.Q3_K): 8, int(Q.Q5_K): 9}
assert set(_CODES) == TRITON_TYPES


@triton.jit
def _f16_at(block_ptrs, offset, mask):
    """The little-endian fp16 at byte ``offset`` of each block, as float32 ([BLOCK_N, 1] pointers)."""
    lo = tl.load(block_ptrs + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(block_ptrs + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(block_ptrs, offsets, mask):
    return tl.load(block_ptrs + offsets, mask=mask, other=0).to(tl.int32)


@triton.jit
def _decode(block_ptrs, j, mask, QTYPE: tl.constexpr):
    """Values ``j`` ([1, QK]: 0..QK-1) of the blocks at ``block_ptrs`` ([BLOCK_N, 1]) -> float32 [BLOCK_N, QK]."""
    if QTYPE == 4:  # Q8_0: d, 32 int8
        q = tl.load(block_ptrs + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _f16_at(block_ptrs, 0, mask)
    if QTYPE == 7:  # Q2_K: 16 bytes of 4-bit scale / 4-bit min pairs, 64 bytes of 2-bit values, d, dmin
        pair = _byte(block_ptrs, j // 16, mask)
        q = (_byte(block_ptrs, 16 + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3
        return _f16_at(block_ptrs, 80, mask) * (pair & 0xF).to(tl.float32) * q.to(tl.float32) \
            - _f16_at(block_ptrs, 82, mask) * (pair >> 4).to(tl.float32)
    if QTYPE == 8:  # Q3_K: 32 bytes of third bits (a clear one subtracts 4), 64 bytes of 2-bit values, 12 of 6-bit scales, d
        sub = j // 16
        low4 = (_byte(block_ptrs, 96 + sub % 8, mask) >> (4 * (sub // 8))) & 0xF
        high2 = (_byte(block_ptrs, 104 + sub % 4, mask) >> (2 * (sub // 4))) & 3
        sc = (low4 | (high2 << 4)) - 32
        q = (_byte(block_ptrs, 32 + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3
        hbit = (_byte(block_ptrs, j % 32, mask) >> (j // 32)) & 1
        return _f16_at(block_ptrs, 108, mask) * sc.to(tl.float32) * (q - 4 * (1 - hbit)).to(tl.float32)
    if QTYPE == 5 or QTYPE == 9:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit sub-scales and mins, [32 bytes of fifth bits,] nibbles
        sub = j // 32  # 8 sub-blocks of 32
        low = sub < 4
        # get_scale_min_k4: sub-blocks 0-3 keep 6 bits in bytes 0-7; 4-7 split theirs across bytes 8-11 and the top bits
        a = _byte(block_ptrs, 4 + sub, mask)  # scales[sub]        (sub < 4)
        b = _byte(block_ptrs, 4 + sub + 4, mask)  # scales[sub + 4]
        c = _byte(block_ptrs, 4 + sub - 4 + 4 * low.to(tl.int32), mask)  # scales[sub - 4] (sub >= 4)
        sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        QS_K: tl.constexpr = 16 if QTYPE == 5 else 48
        q = (_byte(block_ptrs, QS_K + (j // 64) * 32 + j % 32, mask) >> (4 * ((j // 32) % 2))) & 0xF
        if QTYPE == 9:
            q = q | (((_byte(block_ptrs, 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        return _f16_at(block_ptrs, 0, mask) * sc.to(tl.float32) * q.to(tl.float32) \
            - _f16_at(block_ptrs, 2, mask) * mn.to(tl.float32)
    if QTYPE == 6:  # Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
        half = j // 128
        r = j % 128
        lo = (_byte(block_ptrs, half * 64 + r % 64, mask) >> (4 * (r // 64))) & 0xF
        hi = (_byte(block_ptrs, 128 + half * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
        scale = tl.load(block_ptrs + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16_at(block_ptrs, 208, mask) * scale * ((lo | (hi << 4)) - 32).to(tl.float32)
    # 32-value types: d [, m] [, 4 bytes of fifth bits], 16 bytes of nibbles (low ones are values 0-15)
    QS: tl.constexpr = 2 + 2 * (QTYPE % 2) + 4 * (QTYPE // 2)  # where the nibbles start: 2, 4, 6, 8
    q = (_byte(block_ptrs, QS + j % 16, mask) >> (4 * (j // 16))) & 0xF
    if QTYPE == 2 or QTYPE == 3:
        q = q | (((_byte(block_ptrs, QS - 4 + j // 8, mask) >> (j % 8)) & 1) << 4)
    d = _f16_at(block_ptrs, 0, mask)
    if QTYPE == 0:
        return (q - 8).to(tl.float32) * d
    if QTYPE == 2:
        return (q - 16).to(tl.float32) * d
    return q.to(tl.float32) * d + _f16_at(block_ptrs, 2, mask)


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, w_ptr, y_ptr, M, N, num_blocks, stride_xm, stride_wn, stride_ym,
    QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, QK)
    m_mask = rm[:, None] < M
    n_mask = rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_blocks):
        block_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + kb * BLOCK_BYTES
        w = _decode(block_ptrs, j[None, :], n_mask, QTYPE)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kb * QK + j[None, :], mask=m_mask, other=0.0)
        if IEEE:  # float32 activations: no TF32 rounding of either operand
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # 16-bit activations: the weight rounds to theirs, products accumulate in float32
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc, mask=m_mask & (rn[None, :] < N))


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """``x`` [M, cols] times the block matrix (uint8 [N, bytes per row]), transposed: float32 [M, N]."""
    if qtype not in TRITON_TYPES:
        raise ValueError(f"the gguf Triton kernel has no path for type {Q(qtype).name}")
    values, nbytes = block_size(qtype)
    if cols % values or blocks.shape[1] != cols // values * nbytes:
        raise ValueError(f"GGUF {Q(qtype).name} rows of {blocks.shape[1]} bytes do not hold {cols} values")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the gguf Triton kernel takes float32/float16/bfloat16 activations, not {x.dtype}")
    x = x.contiguous()
    blocks = blocks.contiguous()
    m, n = x.shape[0], blocks.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    # tl.dot needs tiles of at least 16 a side; decode (M = 1) pads its tile to 16 rows
    block_m = 16 if m <= 16 else 32
    block_n = 32 if values == 256 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_matmul_kernel[grid](
        x, blocks, y, m, n, cols // values, x.stride(0), blocks.stride(0), y.stride(0),
        QTYPE=_CODES[qtype], QK=values, BLOCK_BYTES=nbytes, BLOCK_M=block_m, BLOCK_N=block_n,
        # Triton's interpreter multiplies bfloat16 tiles as their integer bits: it takes the float32 dot
        IEEE=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu"),
    )
    return y
