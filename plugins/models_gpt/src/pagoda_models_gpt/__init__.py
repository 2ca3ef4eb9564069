"""pagoda model-family plugin: GPT-2, OPT and Falcon (LayerNorm decoders; learned positions, rotary or ALiBi)."""
