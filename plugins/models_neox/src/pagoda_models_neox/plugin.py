"""Entry point of the NeoX-family plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"

_ARCHITECTURES = ("GPTNeoXForCausalLM", "PhiForCausalLM", "StableLmForCausalLM")


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    return [ModelSpec(architecture=arch, cls=f"pagoda_models_neox.neox:{arch}") for arch in _ARCHITECTURES]
