"""Entry point of the Idefics3 plugin: architecture names -> classes (imported lazily)."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    # SmolVLM checkpoints name the same class
    return [ModelSpec(architecture="Idefics3ForConditionalGeneration",
                      cls="pagoda_models_idefics3.idefics3:Idefics3ForConditionalGeneration")]
