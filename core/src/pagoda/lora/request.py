"""Which adapter a request runs with (vLLM's ``LoRARequest``: same fields, same Struct declaration).

Libraries written for vLLM import it unconditionally (lm-eval's vllm model builds one only when
given an adapter path) and pass ``lora_request=None`` otherwise; pagoda's engine refuses a
non-None one with an error naming ``lora_request`` until adapters are served (issue 34).
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True):
    lora_name: str
    # 1-based: vLLM reserves 0 for "no adapter".
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int of at least 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
