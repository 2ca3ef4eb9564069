"""Example model-family plugin for pagoda (a template for third-party plugins)."""

ARCHITECTURE = "ExampleTinyForCausalLM"
