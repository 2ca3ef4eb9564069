"""``vllm.entrypoints.llm``."""

from pagoda.entrypoints.llm import LLM

__all__ = ["LLM"]
