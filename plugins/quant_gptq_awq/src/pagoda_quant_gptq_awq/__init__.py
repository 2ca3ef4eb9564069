"""pagoda quantization plugin for 4-bit GPTQ and AWQ checkpoints (see docs/quantization.md)."""
