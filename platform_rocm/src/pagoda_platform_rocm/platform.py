"""The ROCm platform (AMD GPUs through torch's HIP build). Not verified on hardware.

torch exposes HIP devices through the ``torch.cuda`` API and Triton compiles
for them, so everything past the probe is the CUDA platform's: the same KV
budget rule, graph sizes, pinned memory and Triton attention.
"""

from __future__ import annotations

from pagoda_platform_cuda.platform import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"
    verified_on_hardware = False
    package = "pagoda-platform-rocm"
    supports_graphs = True

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        if not getattr(torch.version, "hip", None):
            return False, f"torch {torch.__version__} is not a ROCm (HIP) build"
        # device_count() reads the visible devices without creating a HIP context.
        if torch.cuda.device_count() == 0:
            return False, "no ROCm device is visible (torch.cuda.device_count() == 0; check HIP_VISIBLE_DEVICES)"
        return True, ""

    def describe(self) -> str:
        import torch

        index = torch.cuda.current_device()
        return f"rocm:{index} {torch.cuda.get_device_name(index)} (HIP {torch.version.hip})"
