"""Multi-LoRA: PEFT adapters served beside the base model, many per step (docs/lora.md).

``request`` (LoRARequest) is what a caller names; ``peft`` reads and checks an adapter's files;
``layers`` holds each linear's fixed adapter slots; ``punica`` is the batched shrink/expand kernel
interface (a torch implementation the platform may replace); ``model_manager`` (worker side) maps
adapters into slots from a host LRU; ``resolver`` finds adapters nobody loaded yet.
"""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
