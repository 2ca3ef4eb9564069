"""Quantization methods: the contract (vLLM's ``QuantizationConfig`` / ``LinearMethodBase``) and how
a model gets its method. The methods themselves are plugins; see docs/quantization.md."""

from __future__ import annotations

from pagoda.quantization.base_config import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from pagoda.quantization.registry import (
    DEQUANTIZE,
    checkpoint_quantization,
    get_quantization_config,
    quantization_methods,
    resolve_quantization,
)

__all__ = [
    "DEQUANTIZE",
    "EmbeddingMethodBase",
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "checkpoint_quantization",
    "get_quantization_config",
    "quantization_methods",
    "resolve_quantization",
]
