"""Start compiling the attention kernel an engine will likely use, before the engine asks for it.

The backend is chosen only after the model's weights are loaded (its KV cache layout depends
on the model), and a first build of the kernel takes seconds. When an engine starts on the
CPU platform with cpu_paged preferred (or requested), this reads the model's config (its
head_dim) and the dtype the platform resolves, and starts that library's build in the
background: the weights load meanwhile. It is a guess made early; the backend asks for the
library it needs when it is chosen, so a wrong or failed guess costs a background build, never
a wrong kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

BACKEND_NAME = "cpu_paged"


def start_for_engine(config: Any) -> None:
    """Start the build for ``config``'s model when cpu_paged will likely serve it; never raises."""
    try:
        target = _likely_kernel(config)
    except Exception as exc:  # noqa: BLE001 - a guess: any failure just means no early start
        logger.debug("cpu_paged: no early kernel build (%s: %s)", type(exc).__name__, exc)
        return
    if target is None:
        return
    from pagoda_attn_cpu.kernel import start_build

    dtype, head_dim, fp8 = target
    logger.debug("cpu_paged: building the %s kernel for head_dim %d in the background", dtype, head_dim)
    if fp8 is None:
        start_build(dtype, head_dim)
    else:
        start_build(dtype, head_dim, fp8)


def _likely_kernel(config: Any) -> tuple[torch.dtype, int, torch.dtype | None] | None:
    """(dtype the kernel computes in, head_dim, the fp8 cache dtype or None)."""
    from pagoda import envs
    from pagoda.attention.kv_quant import is_fp8, resolve_kv_cache_dtype
    from pagoda.config import resolve_model
    from pagoda.platforms import current_platform

    requested = config.device_config.attention_backend or envs.PAGODA_ATTENTION_BACKEND or None
    if requested is not None and requested != BACKEND_NAME:
        return None
    platform = current_platform()
    if platform.device_type != "cpu" or (requested is None and BACKEND_NAME not in platform.attention_backend_preference()):
        return None
    if config.resolved_model is None:
        # What the engine resolves right after the startup hooks, from the same inputs; kept on the
        # config, so it is done once (the engine skips a model already resolved).
        config.resolved_model = resolve_model(config.model, platform)
    resolved = config.resolved_model
    text_config = resolved.text_config
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    cache_dtype = resolve_kv_cache_dtype(config.cache_config.cache_dtype, resolved.dtype)
    if is_fp8(cache_dtype):
        # queries stay in the model dtype over an fp8 cache
        return resolved.dtype, int(head_dim), cache_dtype
    return cache_dtype, int(head_dim), None
