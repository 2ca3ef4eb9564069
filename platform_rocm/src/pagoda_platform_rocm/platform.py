"""The ROCm platform (AMD GPUs through torch's HIP build). Not verified on hardware."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.platforms import Platform

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"
    verified_on_hardware = False
    package = "pagoda-platform-rocm"
    default_block_size = 16
    supports_graphs = True

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        if not getattr(torch.version, "hip", None):
            return False, f"torch {torch.__version__} is not a ROCm (HIP) build"
        if torch.cuda.device_count() == 0:
            return False, "no ROCm device is visible (torch.cuda.device_count() == 0)"
        return True, ""

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.float32, torch.bfloat16, torch.float16]

    def attention_backend_preference(self) -> list[str]:
        return ["triton_paged", "torch_paged"]

    def kv_cache_budget_bytes(self, config: EngineConfig, model_bytes: int, activation_bytes: int) -> int:
        import torch

        if config.cache_config.kv_cache_memory_bytes is not None:
            return config.cache_config.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info()
        return max(int(total * config.cache_config.gpu_memory_utilization) - (total - free) - activation_bytes, 0)

    def check_and_update_config(self, config: EngineConfig) -> None:
        if config.cache_config.block_size is None:
            config.cache_config.block_size = self.default_block_size

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()
