"""``vllm.entrypoints``."""
