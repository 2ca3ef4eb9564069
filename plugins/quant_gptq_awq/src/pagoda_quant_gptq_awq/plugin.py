"""Entry point of the GPTQ / AWQ quantization plugin; the methods' modules are imported only when a model uses them."""

from pagoda.plugins import QuantizationSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    return [QuantizationSpec(name="gptq", cls="pagoda_quant_gptq_awq.config:GPTQConfig"),
            QuantizationSpec(name="awq", cls="pagoda_quant_gptq_awq.config:AWQConfig")]
