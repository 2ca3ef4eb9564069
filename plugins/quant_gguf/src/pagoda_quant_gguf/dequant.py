"""Plain-torch dequantization of GGUF blocks: the reference the kernels are tested against, and
the path on platforms without a kernel (any torch device).

Layouts are ggml's (ggml-common.h); every type here, K-quants included, is dequantized in torch. A row of ``cols`` values is ``cols / block_size`` blocks;
every block starts with its fp16 scale ``d`` (and ``m`` or ``dmin`` where the type has one).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

FLOAT_TYPES: dict[int, torch.dtype] = {int(Q.F32): torch.float32, int(Q.F16): torch.float16, int(Q.BF16): torch.bfloat16}
# block types of 32 values
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
    b = blocks.reshape(-1, nbytes)
    if qtype in K_TYPES:
        return _K_DEQUANT[qtype](b).reshape(rows, cols)
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


# K-quants: super-blocks of 256 values in 16 or 8 sub-blocks with 4- to 8-bit sub-scales (translated
# from the gguf package's numpy dequantizers, which the tests hold these to exactly).
_QK_K = 256


def _shifts(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, _QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lscales = (scales[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], b.device).reshape(1, 2, 1)).reshape(n, 16)
    hscales = (scales[:, 8:].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], b.device).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lscales & 0x0F) | ((hscales & 0x03) << 4)).to(torch.int8).float() - 32
    dl = (d * sc).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), b.device).reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql.float() - ((qh ^ 1) << 2).float()  # a clear bit subtracts 4
    return (dl * q).reshape(n, _QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(n, 8).float(), mn.reshape(n, 8).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin, scales, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:144]
    sc, mn = _scale_min_k4(scales)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 4], b.device).reshape(1, 1, 2, 1)) & 0x0F
    return ((d * sc).reshape(n, -1, 1) * q.reshape(n, -1, 32).float() - (dmin * mn).reshape(n, -1, 1)).reshape(n, _QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin, scales, qh, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:48], b[:, 48:176]
    sc, mn = _scale_min_k4(scales)
    ql = ((qs.reshape(n, -1, 1, 32) >> _shifts([0, 4], b.device).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1, 32)
    qhb = ((qh.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), b.device).reshape(1, 1, 8, 1)) & 1).reshape(n, -1, 32)
    q = (ql | (qhb << 4)).float()
    return ((d * sc).reshape(n, -1, 1) * q - (dmin * mn).reshape(n, -1, 1)).reshape(n, _QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = ((ql.reshape(n, -1, 1, 64) >> _shifts([0, 4], b.device).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device).reshape(1, 1, 4, 1)) & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).float() - 32
    return (dl * q.reshape(n, 16, -1)).reshape(n, _QK_K)


_K_DEQUANT = {int(Q.Q2_K): _q2_k, int(Q.Q3_K): _q3_k, int(Q.Q4_K): _q4_k, int(Q.Q5_K): _q5_k, int(Q.Q6_K): _q6_k}
