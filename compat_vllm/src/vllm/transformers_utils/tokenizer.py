"""``vllm.transformers_utils.tokenizer`` (the older path of ``get_tokenizer``)."""

from vllm._tokenizer import get_tokenizer

__all__ = ["get_tokenizer"]
