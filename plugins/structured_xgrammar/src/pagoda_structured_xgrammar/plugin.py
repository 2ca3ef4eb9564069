"""Entry point of the xgrammar structured-outputs plugin; the backend module is imported only when used."""

from pagoda.plugins import StructuredOutputBackendSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.2"


@hookimpl
def pagoda_register_structured_output_backends() -> list[StructuredOutputBackendSpec]:
    return [StructuredOutputBackendSpec(name="xgrammar", cls="pagoda_structured_xgrammar.backend:XgrammarBackend")]
