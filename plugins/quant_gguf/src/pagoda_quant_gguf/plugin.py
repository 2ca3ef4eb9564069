"""Entry point of the GGUF quantization plugin; the method's module is imported only when a model uses it."""

from pagoda.envs import EnvRegistry
from pagoda.plugins import QuantizationSpec, hookimpl

# 1.5: pagoda_add_env_vars
PAGODA_PLUGIN_API_VERSION = "1.5"


@hookimpl
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    return [QuantizationSpec(name="gguf", cls="pagoda_quant_gguf.config:GGUFConfig")]


@hookimpl
def pagoda_add_env_vars(registry: EnvRegistry) -> None:
    from pagoda_quant_gguf.env_vars import VARIABLES

    registry.add(*VARIABLES)
