"""Entry point of the compressed-tensors quantization plugin; the method's module is imported only when a model uses it."""

from pagoda.envs import EnvRegistry
from pagoda.plugins import QuantizationSpec, hookimpl

# 1.5: pagoda_add_env_vars
PAGODA_PLUGIN_API_VERSION = "1.5"


@hookimpl
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    return [QuantizationSpec(name="compressed-tensors", cls="pagoda_quant_compressed_tensors.config:CompressedTensorsConfig")]


@hookimpl
def pagoda_add_env_vars(registry: EnvRegistry) -> None:
    from pagoda_quant_compressed_tensors.env_vars import VARIABLES

    registry.add(*VARIABLES)
