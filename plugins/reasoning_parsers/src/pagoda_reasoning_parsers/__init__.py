"""pagoda's reasoning parsers for <think>-tag models (vLLM's ``deepseek_r1`` and ``qwen3``)."""
