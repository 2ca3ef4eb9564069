"""Entry point of the llguidance structured-outputs plugin; the backend module is imported only when used."""

from pagoda.plugins import StructuredOutputBackendSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.2"


@hookimpl
def pagoda_register_structured_output_backends() -> list[StructuredOutputBackendSpec]:
    # vLLM's name for its llguidance backend
    return [StructuredOutputBackendSpec(name="guidance", cls="pagoda_structured_llguidance.backend:GuidanceBackend")]
