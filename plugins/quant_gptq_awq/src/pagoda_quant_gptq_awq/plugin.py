"""Entry point of the GPTQ / AWQ quantization plugin; the methods' modules are imported only when a model uses them."""

from pagoda.envs import EnvRegistry
from pagoda.plugins import QuantizationSpec, hookimpl

# 1.5: pagoda_add_env_vars
PAGODA_PLUGIN_API_VERSION = "1.5"


@hookimpl
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    return [QuantizationSpec(name="gptq", cls="pagoda_quant_gptq_awq.config:GPTQConfig"),
            QuantizationSpec(name="awq", cls="pagoda_quant_gptq_awq.config:AWQConfig")]


@hookimpl
def pagoda_add_env_vars(registry: EnvRegistry) -> None:
    from pagoda_quant_gptq_awq.env_vars import VARIABLES

    registry.add(*VARIABLES)
