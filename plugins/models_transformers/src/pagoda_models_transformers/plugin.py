"""Entry point of the transformers fallback: one ModelFallbackSpec, its model class and its check imported lazily."""

from pagoda.plugins import ModelFallbackSpec, hookimpl

# 1.1: pagoda_register_model_fallbacks
PAGODA_PLUGIN_API_VERSION = "1.1"


@hookimpl
def pagoda_register_model_fallbacks() -> list[ModelFallbackSpec]:
    return [
        ModelFallbackSpec(
            name="transformers",
            cls="pagoda_models_transformers.model:TransformersForCausalLM",
            check="pagoda_models_transformers.support:reasons_unsupported",
            description=(
                "any decoder-only causal LM transformers implements whose class supports the attention "
                "interface (_supports_attention_backend)"
            ),
        )
    ]
