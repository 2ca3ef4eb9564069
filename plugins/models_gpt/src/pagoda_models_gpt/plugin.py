"""Entry point of the GPT-family plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"

_ARCHITECTURES = ("GPT2LMHeadModel", "OPTForCausalLM", "FalconForCausalLM")


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    return [ModelSpec(architecture=arch, cls=f"pagoda_models_gpt.gpt:{arch}") for arch in _ARCHITECTURES]
