"""The TPU platform on torch_xla. Not verified on hardware."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from pagoda.platforms import Platform, PlatformDefaults

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig


MIN_TOKEN_BUCKET = 16


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Padded step sizes (powers of two from 16, the last one covering the budget).

    XLA compiles one graph per input shape: padding every step up to a bucket
    bounds the number of compilations to len(buckets).
    """
    if max_num_batched_tokens <= 0:
        raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
    buckets = [MIN_TOKEN_BUCKET]
    while buckets[-1] < max_num_batched_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    verified_on_hardware = False
    package = "pagoda-platform-tpu"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_xla") is None:
            return False, "torch_xla is not installed (pip install torch_xla[tpu])"
        # Checking for TPU chips through the accel device nodes avoids initialising
        # the XLA runtime, which would grab the device.
        if not (os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0") or os.environ.get("TPU_NAME")):
            return False, "no TPU device found (/dev/accel* absent and TPU_NAME unset)"
        return True, ""

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.float32, torch.bfloat16]

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        import torch

        if requested == "auto":
            # The MXU computes in bf16; fp32 runs at a fraction of the speed.
            return torch.bfloat16
        return super().resolve_dtype(requested, checkpoint_dtype)

    def attention_backend_preference(self, spec: Any = None) -> list[str]:
        return ["xla_paged", "torch_paged"]

    def kv_cache_budget_bytes(self, config: EngineConfig, model_bytes: int, activation_bytes: int) -> int:
        if config.cache_config.kv_cache_memory_bytes is not None:
            return config.cache_config.kv_cache_memory_bytes
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        mem = xm.get_memory_info(xm.xla_device())
        total = int(mem.get("bytes_limit", mem.get("kb_total", 0) * 1024))
        used = int(mem.get("bytes_used", 0))
        return max(int(total * config.cache_config.gpu_memory_utilization) - used - activation_bytes, 0)

    def config_defaults(self, config: EngineConfig) -> PlatformDefaults:
        # XLA recompiles per shape: chunked prefill keeps step shapes bounded (the step budget is the
        # engine's default, and token_buckets pads each step up to one of a few sizes).
        return PlatformDefaults(
            requires_chunked_prefill=True,
            kv_cache_budget_rule=(f"gpu_memory_utilization={config.cache_config.gpu_memory_utilization} of the "
                                  "TPU's memory, less what is in use and the activation peak"),
        )

    def device(self) -> torch.device:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        return xm.xla_device()

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        xm.mark_step()
        xm.wait_device_ops()
