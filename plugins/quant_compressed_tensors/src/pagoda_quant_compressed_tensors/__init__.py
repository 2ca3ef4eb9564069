"""pagoda quantization plugin for int8 compressed-tensors checkpoints (see docs/quantization.md)."""
