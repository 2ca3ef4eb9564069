"""Entry point of the Llama-family plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"

_IMPL = "pagoda_models_llama.llama:LlamaForCausalLM"


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    return [
        ModelSpec(architecture=arch, cls=_IMPL)
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    ]
