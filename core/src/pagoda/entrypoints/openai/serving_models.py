"""The models a server answers to: the base model's names and the LoRA adapters (vLLM's ``OpenAIServingModels``).

``--lora-modules`` adapters load at start-up (``name=path``, or vLLM's JSON form
``{"name": ..., "path": ..., "base_model_name": ...}``); with ``PAGODA_ALLOW_RUNTIME_LORA_UPDATING`` set,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and drop them while serving. A request's
``model`` names the base model or an adapter; ``/v1/models`` lists both, each adapter with its parent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.lora_modules import LoRAModulePath
from pagoda.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError
from pagoda.lora.request import LoRARequest


def lora_error(exc: Exception) -> APIError:
    """An adapter the engine refused, as the client's error: 404 when its files are not there, else 400."""
    if isinstance(exc, LoRAAdapterNotFoundError):
        return APIError(str(exc), 404, "model", code="model_not_found")
    return APIError(str(exc), 400, "model")


@dataclass
class ServingModels:
    engine: Any  # AsyncLLM
    base_model_names: list[str]
    base_model_path: str
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)
    _next_id: int = 1
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def enable_lora(self) -> bool:
        return self.engine.config.lora_config is not None

    def resolve(self, model: str | None, allow_lora: bool = True) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model, or no ``model``); 404 for a name nobody serves."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            served = self.base_model_names + list(self.lora_requests)
            raise APIError(f"The model `{model}` does not exist; this server serves {served}.", 404, "model",
                           code="model_not_found")
        if not allow_lora:
            raise APIError(f"`{model}` is a LoRA adapter; this endpoint serves the base model only "
                           f"({self.base_model_names[0]})", 400, "model")
        return lora

    async def resolve_async(self, model: str | None) -> LoRARequest | None:
        """``resolve``, and for a name nobody loaded the LoRA resolvers (``pagoda.lora.resolver``), which are
        asked only with PAGODA_ALLOW_RUNTIME_LORA_UPDATING (vLLM's rule); the first answer is loaded."""
        try:
            return self.resolve(model)
        except APIError as missing:
            from pagoda import envs
            from pagoda.lora.resolver import load_resolvers

            if model is None or not self.enable_lora or not envs.PAGODA_ALLOW_RUNTIME_LORA_UPDATING:
                raise
            for resolver in load_resolvers():
                found = await resolver.resolve_lora(self.base_model_path, model)
                if found is not None:
                    if model not in self.lora_requests:  # (another request may have loaded it meanwhile)
                        await self.load_lora_adapter(model, found.lora_path, found.base_model_name)
                    return self.lora_requests[model]
            raise missing from None

    async def load_static(self, modules: list[LoRAModulePath]) -> None:
        """The ``--lora-modules`` adapters, loaded before the server accepts requests (a bad one stops the start)."""
        for module in modules:
            await self.load_lora_adapter(module.name, module.path, module.base_model_name)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> str:
        if not self.enable_lora:
            raise APIError("this server was started without --enable-lora: it serves no LoRA adapters", 400, "lora_name")
        if not lora_name or not lora_path:
            raise APIError("both 'lora_name' and 'lora_path' must be provided", 400, "lora_name")
        async with self._lock:
            if lora_name in self.lora_requests or lora_name in self.base_model_names:
                raise APIError(f"The lora adapter '{lora_name}' has already been loaded.", 400, "lora_name")
            request = LoRARequest(lora_name, self._next_id, lora_path, base_model_name=base_model_name)
            try:
                await self.engine.add_lora(request)
            except (LoRAAdapterError, ValueError) as exc:
                raise lora_error(exc) from None
            self._next_id += 1
            self.lora_requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str) -> str:
        if not lora_name:
            raise APIError("'lora_name' must be provided", 400, "lora_name")
        async with self._lock:
            request = self.lora_requests.get(lora_name)
            if request is None:
                raise APIError(f"The lora adapter '{lora_name}' cannot be found.", 404, "lora_name",
                               code="model_not_found")
            try:
                await self.engine.remove_lora(request.lora_int_id)
            except ValueError as exc:
                raise APIError(str(exc), 400, "lora_name") from None
            del self.lora_requests[lora_name]
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: the base model's names, then each adapter with its parent (vLLM's cards)."""
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "pagoda",
                  "root": self.base_model_path, "parent": None, "max_model_len": self.max_model_len, "permission": []}
                 for name in self.base_model_names]
        for lora in self.lora_requests.values():
            cards.append({"id": lora.lora_name, "object": "model", "created": self.created, "owned_by": "pagoda",
                          "root": lora.lora_path, "parent": lora.base_model_name or self.base_model_names[0],
                          "max_model_len": self.max_model_len, "permission": []})
        return cards
