"""Which quantization method a model runs with, and where each method's class comes from.

Methods are plugins (``pagoda.quantization`` entry points implementing
``pagoda_register_quantization_methods``), listed by ``pagoda plugins list``; core ships none.
The method is chosen as vLLM chooses it: ``quantization=`` when given, else the checkpoint's
``quantization_config.quant_method``, else ``"gguf"`` for a GGUF file whose matrices are stored
in quantized block types. The platform must list the method in ``supported_quantization``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagoda.quantization.base_config import QuantizationConfig

logger = logging.getLogger(__name__)

# pagoda extension (vLLM has no such value): load a GGUF file's quantized tensors dequantized
# to the model dtype, the path every GGUF file took before the gguf method existed.
DEQUANTIZE = "none"


def quantization_methods() -> dict[str, Any]:
    """Installed methods: name -> ``QuantizationSpec`` (from the plugin manager)."""
    from pagoda.plugins import get_plugin_manager

    return get_plugin_manager().quantization_methods()


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    """The ``QuantizationConfig`` class registered as ``name``; ValueError naming the installed ones."""
    specs = quantization_methods()
    spec = specs.get(name)
    if spec is None:
        installed = ", ".join(sorted(specs)) or "none"
        raise ValueError(
            f"quantization method {name!r} is not installed (installed methods: {installed}); quantization "
            f"methods are plugins: install the one that provides {name!r} (see docs/quantization.md)"
        )
    cls = spec.load()
    if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
        raise TypeError(f"quantization method {name!r} ({spec.cls}) is not a pagoda.quantization.QuantizationConfig")
    return cls


def checkpoint_quantization(source: Any, hf_config: Any) -> tuple[str | None, dict[str, Any]]:
    """(the method the checkpoint is stored in, its ``quantization_config``): (None, {}) for float weights."""
    if source.kind == "gguf":
        from pagoda.model_loader.gguf.weights import gguf_dtype

        return (None, {}) if gguf_dtype(source.gguf_path) is not None else ("gguf", {})
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None, {}
    if not isinstance(config, dict):
        to_dict = getattr(config, "to_dict", None)
        config = to_dict() if callable(to_dict) else dict(vars(config))
    method = config.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"the model's quantization_config has no quant_method: {config}")
    return method, dict(config)


def resolve_quantization(
    requested: str | None, source: Any, hf_config: Any, platform: Any, dtype: torch.dtype
) -> QuantizationConfig | None:
    """The model's ``QuantizationConfig``, or None for float weights; ValueError saying why it cannot run.

    ``requested``: ``quantization=`` (None = what the checkpoint says; ``"none"`` = a GGUF file
    dequantized at load, pagoda's extension).
    """
    detected, config = checkpoint_quantization(source, hf_config)
    if requested == DEQUANTIZE:
        if detected is not None and detected != "gguf":
            raise ValueError(
                f"quantization='none' loads a GGUF file dequantized; this checkpoint is stored as {detected!r}, "
                "which pagoda does not dequantize at load"
            )
        if detected == "gguf":
            logger.info("quantization='none': the GGUF file's quantized tensors are dequantized to %s at load", dtype)
        return None
    if requested is None:
        if detected is None:
            return None
        name = detected
        if detected == "gguf":
            # A GGUF file has always loaded (dequantized) without a plugin; keep that where the
            # gguf method is not installed or this platform cannot run it, and say so.
            why = _unavailable(name, platform)
            if why is not None:
                logger.warning("GGUF file %s loads dequantized to %s: %s", source.display_name, dtype, why)
                return None
    else:
        name = requested
        if detected is not None and detected != name:
            raise ValueError(
                f"quantization={name!r} does not fit the checkpoint, which is stored as {detected!r} "
                f"({'a GGUF file' if source.kind == 'gguf' else 'its quantization_config.quant_method'})"
            )
        if source.kind == "gguf" and detected is None and name == "gguf":
            raise ValueError(f"quantization='gguf' but {source.display_name} stores float matrices only: nothing is quantized")
    cls = get_quantization_config(name)
    why = _unavailable(name, platform)
    if why is not None:
        raise ValueError(why)
    quant_config = cls.from_config(config)
    quant_config.dequantize_unsupported = requested is None and cls.dequantizable
    act_dtypes = quant_config.get_supported_act_dtypes()
    if dtype not in act_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in act_dtypes)
        raise ValueError(f"quantization {name!r} runs with activations in {names}, not {str(dtype).removeprefix('torch.')}: pass dtype=")
    return quant_config


def _unavailable(name: str, platform: Any) -> str | None:
    """Why ``name`` cannot run here (not installed, or the platform does not run it), or None."""
    if name not in quantization_methods():
        installed = ", ".join(sorted(quantization_methods())) or "none"
        return (f"quantization method {name!r} is not installed (installed methods: {installed}); "
                "see docs/quantization.md")
    supported = list(platform.supported_quantization)
    if name not in supported:
        runs = ", ".join(supported) or "no quantization method"
        return f"platform {platform.name!r} cannot run quantization {name!r} (it runs: {runs})"
    return None
