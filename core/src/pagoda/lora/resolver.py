"""LoRA resolvers (vLLM's ``LoRAResolver``): find an adapter a request names that nobody loaded yet.

A resolver plugin returns ``LoRAResolverSpec(name, cls)`` from ``pagoda_register_lora_resolvers``
(entry-point group ``pagoda.lora_resolvers``); a script may also ``LoRAResolverRegistry.register_resolver``
an instance. Core brings one: ``FilesystemResolver``, active when ``PAGODA_LORA_RESOLVER_CACHE_DIR``
names a directory, which answers ``lora_name`` with ``<dir>/<lora_name>`` when that is a PEFT LoRA
adapter of the served base model. The server asks the resolvers only with
``PAGODA_ALLOW_RUNTIME_LORA_UPDATING`` set (vLLM's rule: resolving loads files at a client's word).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path

from pagoda.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAResolver(ABC):
    @abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The adapter ``lora_name`` for ``base_model_name``, or None if this resolver does not know it.

        ``lora_int_id`` of the answer is replaced by the server's own (ids are the server's to hand out).
        """


class _Registry:
    """vLLM's ``LoRAResolverRegistry``: resolvers by name (in-script ones, then the plugins')."""

    def __init__(self) -> None:
        self.resolvers: dict[str, LoRAResolver] = {}

    def register_resolver(self, resolver_name: str, resolver: LoRAResolver) -> None:
        if not isinstance(resolver, LoRAResolver):
            raise TypeError(f"resolver {resolver_name!r} is a {type(resolver).__name__}, not a LoRAResolver")
        if resolver_name in self.resolvers:
            logger.warning("LoRA resolver %r registered twice; keeping the first", resolver_name)
            return
        self.resolvers[resolver_name] = resolver

    def get_supported_resolvers(self) -> list[str]:
        return list(self.resolvers)

    def get_resolver(self, resolver_name: str) -> LoRAResolver:
        if resolver_name not in self.resolvers:
            raise KeyError(f"LoRA resolver {resolver_name!r} is not registered; registered: {self.get_supported_resolvers()}")
        return self.resolvers[resolver_name]


LoRAResolverRegistry = _Registry()


class FilesystemResolver(LoRAResolver):
    """``<cache_dir>/<lora_name>`` when it holds a PEFT LoRA adapter of the served base model (vLLM's rule)."""

    def __init__(self, lora_cache_dir: str | Path) -> None:
        self.lora_cache_dir = Path(lora_cache_dir)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        path = self.lora_cache_dir / lora_name
        if "/" in lora_name or lora_name.startswith(".") or not (path / "adapter_config.json").is_file():
            return None
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return None
        base = config.get("base_model_name_or_path")
        if str(config.get("peft_type", "")).upper() != "LORA" or (base and base != base_model_name):
            return None
        return LoRARequest(lora_name, 1, str(path), base_model_name=base_model_name)


def load_resolvers() -> list[LoRAResolver]:
    """Every resolver: the registered ones, the plugins' (built once here), then the filesystem one if configured."""
    from pagoda import envs
    from pagoda.plugins import get_plugin_manager

    for name, spec in get_plugin_manager().lora_resolvers().items():
        if name not in LoRAResolverRegistry.resolvers:
            LoRAResolverRegistry.register_resolver(name, spec.load()())
    cache_dir = envs.PAGODA_LORA_RESOLVER_CACHE_DIR
    if cache_dir is not None and "lora_filesystem_resolver" not in LoRAResolverRegistry.resolvers:
        LoRAResolverRegistry.register_resolver("lora_filesystem_resolver", FilesystemResolver(cache_dir))
    return list(LoRAResolverRegistry.resolvers.values())
