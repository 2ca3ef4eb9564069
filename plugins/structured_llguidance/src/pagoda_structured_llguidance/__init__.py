"""pagoda's structured-outputs backend on llguidance (vLLM's backend name: ``guidance``)."""
