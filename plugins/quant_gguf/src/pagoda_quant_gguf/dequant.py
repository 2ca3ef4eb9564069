"""Plain-torch dequantization of GGUF blocks: the reference the kernels are tested against, and
the path on platforms without a kernel (any torch device).

Layouts are ggml's (ggml-common.h). A row of ``cols`` values is ``cols / block_size`` blocks;
every block starts with its fp16 scale ``d`` (and ``m`` or ``dmin`` where the type has one).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType

FLOAT_TYPES: dict[int, torch.dtype] = {int(Q.F32): torch.float32, int(Q.F16): torch.float16, int(Q.BF16): torch.bfloat16}
# block types with a torch dequantizer here; the K-quants go through the gguf package's numpy code
TORCH_TYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
K_TYPES = frozenset(int(t) for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))
SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | TORCH_TYPES | K_TYPES


def type_name(qtype: int) -> str:
    return Q(qtype).name


def block_size(qtype: int) -> tuple[int, int]:
    """(values, bytes) of one block; (1, itemsize) for the float types."""
    if qtype in FLOAT_TYPES:
        return 1, torch.empty((), dtype=FLOAT_TYPES[qtype]).element_size()
    values, nbytes = GGML_QUANT_SIZES[Q(qtype)]
    return values, nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: the low nibbles are values 0..15, the high ones 16..31 (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] of 0 or 16: bit i is value i's fifth bit."""
    bits = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return (((qh.unsqueeze(-1) >> bits) & 1).reshape(qh.shape[0], 32) << 4)


def dequantize_blocks(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """``blocks`` uint8 [rows, bytes per row] of GGML type ``qtype`` -> float32 [rows, cols]."""
    rows = blocks.shape[0]
    if qtype in FLOAT_TYPES:
        return blocks.contiguous().view(FLOAT_TYPES[qtype]).reshape(rows, cols).float()
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {type_name(qtype)} is not supported by pagoda-quant-gguf")
    values, nbytes = block_size(qtype)
    if qtype in K_TYPES:
        # the gguf package's numpy dequantizer (the same code the dequantizing loader uses)
        out = gguf_dequantize(blocks.cpu().numpy().astype(np.uint8, copy=False), Q(qtype))
        return torch.from_numpy(np.ascontiguousarray(out)).reshape(rows, cols).to(blocks.device)
    b = blocks.reshape(-1, nbytes)
    d = _f16(b[:, 0:2])
    if qtype == Q.Q8_0:
        w = b[:, 2:34].contiguous().view(torch.int8).float() * d
    elif qtype == Q.Q4_0:
        w = (_nibbles(b[:, 2:18]).float() - 8) * d
    elif qtype == Q.Q4_1:
        w = _nibbles(b[:, 4:20]).float() * d + _f16(b[:, 2:4])
    elif qtype == Q.Q5_0:
        q = _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6])
        w = (q.float() - 16) * d
    else:  # Q5_1
        q = _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8])
        w = q.float() * d + _f16(b[:, 2:4])
    return w.reshape(rows, cols)
