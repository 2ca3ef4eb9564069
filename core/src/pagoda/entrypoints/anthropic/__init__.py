"""Anthropic's Messages API (``/v1/messages``) served over the chat completion path, as vLLM serves it."""
