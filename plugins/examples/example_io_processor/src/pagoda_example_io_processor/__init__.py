"""Example IO processor plugin for pagoda (a template for third-party plugins)."""

# The name a server or LLM selects the processor by (--io-processor-plugin chunked_embedding).
PROCESSOR_NAME = "chunked_embedding"
