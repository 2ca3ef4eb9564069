"""``vllm.renderers.hf`` (the newer path of the chat template resolver)."""

from vllm._tokenizer import resolve_hf_chat_template as resolve_chat_template

__all__ = ["resolve_chat_template"]
