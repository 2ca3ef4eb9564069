"""Entry point of the compressed-tensors quantization plugin; the method's module is imported only when a model uses it."""

from pagoda.plugins import QuantizationSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    return [QuantizationSpec(name="compressed-tensors", cls="pagoda_quant_compressed_tensors.config:CompressedTensorsConfig")]
