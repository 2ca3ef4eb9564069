"""Triton int8 kernels: the CUDA / ROCm path of the ``compressed-tensors`` method.

* ``quantize_per_token``: dynamic symmetric int8 per row (scale = max|x| / 127, q = round half
  to even of x / scale), what the torch reference in ``kernels`` computes, value for value.
* ``w8a8_matmul``: int8 x int8 tiles multiplied with int32 accumulation (tensor-core IMMA on a
  GPU), rescaled once per output by the row's activation scale and the channel's weight scale.
* ``w8a16_matmul``: int8 weight tiles times their (per channel or per group) scale, converted in
  registers and multiplied with float activations; the weight stays int8 in memory.

Tested against the torch references under ``TRITON_INTERPRET=1`` where there is no GPU.
Imported only where it runs: ``triton`` is not a dependency of a CPU install.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.max(amax, axis=0) / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    for k in range(0, K, BLOCK_K):
        mask = k + cols < K
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, safe)  # correctly rounded, as torch's x / scale
        # round half to even (torch.round): adding and taking away 1.5 * 2^23 leaves the float32
        # sum's own round-to-nearest-even on the integer grid; |v| <= 127, far inside its range
        v = (v + 12582912.0) - 12582912.0
        v = tl.where(scale > 0, tl.minimum(tl.maximum(v, -127.0), 127.0), 0.0)
        tl.store(q_ptr + row * stride_q + k + cols, v.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _w8a8_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_q, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk)[None, :] < K
        a = tl.load(q_ptr + rm[:, None].to(tl.int64) * stride_q + k + rk[None, :], mask=(rm[:, None] < M) & k_mask, other=0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + k + rk[None, :], mask=(rn[:, None] < N) & k_mask, other=0)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, groups, group_size, stride_x, stride_w, stride_y,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk)[None, :] < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + k + rk[None, :], mask=(rm[:, None] < M) & k_mask, other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + k + rk[None, :], mask=n_mask & k_mask, other=0)
        # each value's own group scale: any group size, tiles need not line up with groups
        s = tl.load(ws_ptr + rn[:, None].to(tl.int64) * groups + (k + rk)[None, :] // group_size,
                    mask=n_mask & k_mask, other=0.0)
        w = w.to(tl.float32) * s
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(m: int, n: int) -> tuple[int, int, tuple[int, int]]:
    # tl.dot needs 16 a side: decode (M = 1) pads its tile to 16 rows
    block_m = 16 if m <= 16 else 64
    block_n = 64
    return block_m, block_n, (triton.cdiv(m, block_m), triton.cdiv(n, block_n))


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the int8 Triton kernels take 2-D float32/float16/bfloat16 activations, not {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.contiguous()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1])."""
    x = _check_x(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                    BLOCK_K=min(1024, triton.next_power_of_2(k)))
    elif m:
        scale.zero_()
    return q, scale


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] times the int8 weight [N, K] with its per-channel scales [N], transposed: float32 [M, N]."""
    q, xs = quantize_per_token(x)
    m, k = q.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.int8:
        raise ValueError(f"int8 weight {weight.dtype} {tuple(weight.shape)} for activations of {k} columns")
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, grid = _tiles(m, n)
    weight = weight.contiguous()
    _w8a8_kernel[grid](q, xs, weight, scale.float().contiguous(), y if bias is None else bias.contiguous(), y,
                       m, n, k, q.stride(0), weight.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64)
    return y


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] times the int8 weight [N, K] scaled per group ([N, G], G = ceil(K / group_size)): float32 [M, N]."""
    x = _check_x(x)
    m, k = x.shape
    n = weight.shape[0]
    groups = scale.shape[1]
    if weight.shape[1] != k or weight.dtype != torch.int8 or groups != -(-k // group_size):
        raise ValueError(f"int8 weight {weight.dtype} {tuple(weight.shape)} with scales {tuple(scale.shape)} "
                         f"(groups of {group_size}) for activations of {k} columns")
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, grid = _tiles(m, n)
    weight = weight.contiguous()
    _w8a16_kernel[grid](x, weight, scale.float().contiguous(), y if bias is None else bias.contiguous(), y,
                        m, n, k, groups, group_size, x.stride(0), weight.stride(0), y.stride(0),
                        HAS_BIAS=bias is not None,
                        # Triton's interpreter multiplies bfloat16 tiles as their integer bits: float32 there
                        IEEE=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu"),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64)
    return y
