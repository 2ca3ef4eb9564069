"""Entry point of the Llama-family plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"

_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    # Each architecture has its own class in llama.py (they differ in biases, qk-norm, sliding windows,
    # checkpoint layouts and MoE MLPs).
    return [ModelSpec(architecture=arch, cls=f"pagoda_models_llama.llama:{arch}") for arch in _ARCHITECTURES]
