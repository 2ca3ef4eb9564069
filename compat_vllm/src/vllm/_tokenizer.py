"""vLLM's tokenizer helpers over pagoda's loader (one implementation behind both of vLLM's module paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def get_tokenizer(
    tokenizer_name: str | Path,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs: Any,
) -> Any:
    """The tokenizer pagoda's engine would load for ``tokenizer_name`` (a HF directory, .gguf file or hub id).

    vLLM forwards extra arguments to ``AutoTokenizer.from_pretrained``; pagoda's loader takes none,
    so any is refused by name rather than dropped (it could change the token ids).
    """
    from pagoda.model_loader.tokenizer import load_tokenizer, resolve_tokenizer_path

    if args or kwargs:
        named = [f"positional argument {a!r}" for a in args] + sorted(kwargs)
        raise TypeError(f"get_tokenizer: {', '.join(named)} not supported by pagoda's tokenizer loader")
    if tokenizer_mode != "auto":
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported: pagoda loads the fast tokenizer ('auto')")
    source = resolve_tokenizer_path(tokenizer_name, revision, download_dir)
    return load_tokenizer(source, download_dir=download_dir, trust_remote_code=trust_remote_code)


def resolve_hf_chat_template(
    tokenizer: Any,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    *,
    model_config: Any = None,
    trust_remote_code: bool | None = None,
) -> str | None:
    """The template a chat request renders with: the one given, else the tokenizer's own (None if it has none).

    ``tools``, ``model_config`` and ``trust_remote_code`` are vLLM's inputs for choosing among a
    processor's templates; pagoda's chat path renders the tokenizer's template, so they pick nothing here.
    """
    if chat_template is not None:
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None
