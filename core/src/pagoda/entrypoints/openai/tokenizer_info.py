"""GET /tokenizer_info (vLLM's ``--enable-tokenizer-info-endpoint``): the tokenizer's configuration as JSON.

Clients that tokenize remotely (lm-eval's ``tokenizer_backend=remote``) rebuild their view of the tokenizer from it:
special tokens, ``model_max_length``, the chat template, the added tokens.
"""

from __future__ import annotations

from typing import Any

# where the files were read from and how: facts of the server's disk, of no use to a client
_LOCAL_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only",
               "cache_dir")


def _json_value(value: Any) -> Any:
    """AddedToken -> its text; containers recursively; anything else JSON cannot hold -> its str()."""
    content = getattr(value, "content", None)
    if isinstance(content, str) and hasattr(value, "special"):
        return content
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


def _added_token(token: Any) -> dict[str, Any]:
    fields = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
    return {f: getattr(token, f) for f in fields if hasattr(token, f)}


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's init configuration less local paths, with its class and the chat template the server uses."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in _LOCAL_KEYS:
        config.pop(key, None)
    added = config.pop("added_tokens_decoder", None) or {}
    info: dict[str, Any] = {k: _json_value(v) for k, v in config.items()}
    if added:
        info["added_tokens_decoder"] = {str(i): _added_token(t) for i, t in added.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info
