"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A msgspec Struct, as vLLM's is: it travels inside ``EngineCoreRequest`` to the core and inside
``NewRequestData`` to the workers. Two requests name the same adapter when their ``lora_name`` is
the same (vLLM's equality); ``lora_int_id`` (>= 1) keys the adapter's slot and prefix-cache blocks.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # the model the adapter was trained on (vLLM's field; the server lists it as the adapter's parent)
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's directory) is required")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
