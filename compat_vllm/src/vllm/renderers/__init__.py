"""``vllm.renderers``."""
