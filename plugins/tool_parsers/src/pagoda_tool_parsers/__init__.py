"""pagoda's tool-call parsers (vLLM's names): hermes, llama3_json, mistral, pythonic."""
