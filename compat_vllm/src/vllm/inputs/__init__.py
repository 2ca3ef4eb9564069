"""``vllm.inputs``: the prompt types ``LLM.generate`` takes."""

from pagoda.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
