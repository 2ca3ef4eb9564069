"""``vllm.tokenizers`` (vLLM >= 0.12's path of ``get_tokenizer``)."""

from vllm._tokenizer import get_tokenizer

__all__ = ["get_tokenizer"]
