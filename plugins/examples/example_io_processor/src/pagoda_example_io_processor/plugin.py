"""Entry point of the example plugin: only the spec, so discovery imports nothing heavy.

The processor class is named by a ``"module:Class"`` string and imported only
when an engine selects it.
"""

from pagoda.plugins import IOProcessorSpec, hookimpl
from pagoda_example_io_processor import PROCESSOR_NAME

# The plugin API this plugin was written for; core refuses it if incompatible.
PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_io_processors() -> list[IOProcessorSpec]:
    return [IOProcessorSpec(name=PROCESSOR_NAME, cls="pagoda_example_io_processor.processor:ChunkedEmbeddingProcessor")]
