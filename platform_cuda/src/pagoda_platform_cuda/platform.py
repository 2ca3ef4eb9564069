"""The CUDA platform (NVIDIA GPUs)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagoda.platforms import Platform, PlatformDefaults
from pagoda_platform_cuda.gpu_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, default_capture_sizes, kv_budget_from_memory

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.worker.graphs import GraphCapturer

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    # No GPU was available while this was built and tested (CPU-only CI, Triton interpreter): flip it
    # once the GPU checks in docs/benchmarks.md have run on a real device.
    verified_on_hardware = False
    package = "pagoda-platform-cuda"
    supports_graphs = True
    # quantization methods with GPU kernels (Triton: pagoda-quant-gptq-awq's dequantize-matmul, pagoda-quant-gguf's
    # on the GGUF blocks, pagoda-quant-compressed-tensors' int8 W8A8 / W8A16; tested under the Triton
    # interpreter only; see docs/quantization.md)
    supported_quantization = ["gptq", "awq", "gguf", "compressed-tensors"]

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
            return False, "no CUDA device is visible (torch.cuda.device_count() == 0; check CUDA_VISIBLE_DEVICES)"
        return True, ""

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.float32, torch.bfloat16, torch.float16]

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        import torch

        if requested == "auto" and checkpoint_dtype in (None, torch.float32):
            # fp32 wastes tensor cores and halves the KV cache; serve in 16 bits like vLLM.
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            logger.info("dtype=auto on CUDA with a %s checkpoint: serving in %s", checkpoint_dtype, dtype)
            return dtype
        return super().resolve_dtype(requested, checkpoint_dtype)

    def attention_backend_preference(self, spec: Any = None) -> list[str]:
        return ["triton_paged", "torch_paged"]

    def kv_cache_budget_bytes(self, config: EngineConfig, model_bytes: int, activation_bytes: int) -> int:
        import torch

        if config.cache_config.kv_cache_memory_bytes is not None:
            return config.cache_config.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info()
        return kv_budget_from_memory(total, free, config.cache_config.gpu_memory_utilization, activation_bytes)

    def config_defaults(self, config: EngineConfig) -> PlatformDefaults:
        return PlatformDefaults(
            max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
            graphs=True,
            graph_sizes=tuple(default_capture_sizes(config.scheduler_config.max_num_seqs)),
            kv_cache_budget_rule=(f"gpu_memory_utilization={config.cache_config.gpu_memory_utilization} of the "
                                  "device's memory, less what is in use and the activation peak"),
        )

    def graph_capturer(self, roots: list[object]) -> tuple[GraphCapturer | None, str]:
        # a CUDA graph replays device work only: nothing it reads needs keeping alive beyond the runner's own
        import torch

        if not torch.cuda.is_available():
            return None, "no CUDA device is available"
        from pagoda.worker.graphs import CudaGraphCapture

        return CudaGraphCapture(), ""

    def init_worker(self, config: EngineConfig) -> None:
        import os

        import torch

        # a rank's device: LOCAL_RANK as pagoda's mp workers and torchrun set it; 0 for one rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def get_device_communicator_cls(self) -> str:
        return "pagoda_platform_cuda.communicator:CudaCommunicator"

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

    def memory_stats(self) -> dict[str, Any]:
        import torch

        free, total = torch.cuda.mem_get_info()
        return {
            "total_bytes": total,
            "free_bytes": free,
            "allocated_bytes": torch.cuda.memory_allocated(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        }

    def describe(self) -> str:
        import torch

        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index} {torch.cuda.get_device_name(index)} (sm_{major}{minor}, CUDA {torch.version.cuda})"
