"""KV cache dtypes, and the fp8 quantization every attention backend applies the same way.

``kv_cache_dtype`` takes vLLM's names: ``auto`` (the model dtype), ``float32`` /
``bfloat16`` / ``float16``, and ``fp8`` (= ``fp8_e4m3``) / ``fp8_e5m2``. An fp8 cache
stores ``saturate(x / scale)`` as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` and
reads back ``fp8 * scale``, with one key scale and one value scale per layer
(vLLM's ``k_scale`` / ``v_scale``). The scales are 1.0 unless
``calculate_kv_scales`` derives them from the first step's keys and values
(``max|k| / 200``, ``max|v| / 100``: vLLM's ``K_SCALE_CONSTANT`` / ``V_SCALE_CONSTANT``
defaults). Out-of-range values saturate to the format's largest finite value, as
vLLM's CUDA cache kernels do (a plain ``.to(float8_e4m3fn)`` would give NaN).
"""

from __future__ import annotations

import torch

FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FLOAT_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT defaults: calculate_kv_scales sets scale = max|x| / constant.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a ``kv_cache_dtype`` name stores (``auto``: the model's)."""
    if name == "auto":
        return model_dtype
    found = FP8_KV_CACHE_DTYPES.get(name) or FLOAT_KV_CACHE_DTYPES.get(name)
    if found is None:
        names = ", ".join(["auto", *FLOAT_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES])
        raise ValueError(f"kv_cache_dtype={name!r} is not one of {names}")
    return found


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it: fp8 = saturate(x / scale) rounded to nearest even; else a cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """Cache contents in ``dtype``: fp8 values times their scale (float32 math); else a cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def byte_view(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8, for the copies torch has no fp8 kernel for (index_copy_, index_select on CPU)."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def read_cached(cached: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows gathered from a cache as attention reads them: fp8 dequantized to ``dtype``; others as they are."""
    if not is_fp8(cached.dtype):
        return cached
    if scale is None:
        raise ValueError(f"an fp8 KV cache ({cached.dtype}) needs the layer's k_scale and v_scale")
    return dequantize_kv(cached, dtype, scale)
