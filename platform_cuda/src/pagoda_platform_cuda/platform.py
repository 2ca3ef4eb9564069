"""The CUDA platform (NVIDIA GPUs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.platforms import Platform

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    verified_on_hardware = True
    package = "pagoda-platform-cuda"
    default_block_size = 16
    supports_graphs = True

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        if getattr(torch.version, "hip", None):
            return False, "this torch is a ROCm (HIP) build; use pagoda-platform-rocm"
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU-only build (no CUDA support compiled in)"
        # device_count() asks NVML and does not initialise a CUDA context.
        if torch.cuda.device_count() == 0:
            return False, "no CUDA device is visible (torch.cuda.device_count() == 0)"
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
        budget = int(total * config.cache_config.gpu_memory_utilization) - (total - free) - activation_bytes
        return max(budget, 0)

    def check_and_update_config(self, config: EngineConfig) -> None:
        if config.cache_config.block_size is None:
            config.cache_config.block_size = self.default_block_size

    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def seed_everything(self, seed: int) -> None:
        import torch

        super().seed_everything(seed)
        torch.cuda.manual_seed_all(seed)
