"""Entry point of the LLaVA plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    return [ModelSpec(architecture="LlavaForConditionalGeneration",
                      cls="pagoda_models_llava.llava:LlavaForConditionalGeneration")]
