"""Entry point of the example plugin: only specs, so discovery never imports torch models.

core imports this module when the plugin loads; the model class is named by a
``"module:Class"`` string and imported only when a model with this architecture
is served.
"""

from pagoda.plugins import ModelSpec, hookimpl
from pagoda_example_model import ARCHITECTURE

# The plugin API this plugin was written for; core refuses it if incompatible.
PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    return [ModelSpec(architecture=ARCHITECTURE, cls="pagoda_example_model.model:ExampleTinyForCausalLM")]
