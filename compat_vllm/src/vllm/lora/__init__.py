"""``vllm.lora``."""
