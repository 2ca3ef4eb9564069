"""``vllm.engine``."""
