"""LoRA adapters (vLLM's ``vllm.lora``): the request-side record; the engine refuses adapters until LoRA lands."""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
