"""``vllm.transformers_utils``."""
