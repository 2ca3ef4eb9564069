"""``vllm.lora.request``."""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
