"""``vllm.entrypoints.chat_utils``."""

from vllm._tokenizer import resolve_hf_chat_template

__all__ = ["resolve_hf_chat_template"]
