"""The model's tokenizer, from a HF directory or from a GGUF file's metadata (vocabulary and chat template)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.model_loader.convert_cache import ConvertCache
from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.hub import HubModelId, snapshot_path
from pagoda.model_loader.source import ModelSource, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)


def load_tokenizer(
    source: ModelSource, tokenizer: str | Path | None = None, revision: str | None = None,
    download_dir: str | Path | None = None, trust_remote_code: bool = False,
) -> PreTrainedTokenizerFast:
    """The fast tokenizer of ``tokenizer`` (a HF directory, .gguf file or hub id) or, when None, of the model itself.

    ``trust_remote_code`` lets transformers import the directory's own tokenizer class (``auto_map``).
    """
    # transformers takes seconds to import: only pay for it when a tokenizer is loaded
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer is None and revision is not None:
        raise ModelLoadError(f"tokenizer_revision={revision!r} needs a tokenizer given by hub id (tokenizer=...)")
    tokenizer_source = source if tokenizer is None else resolve_tokenizer_path(tokenizer, revision, download_dir)
    loaded: Any
    try:
        if tokenizer_source.kind == "gguf":
            loaded = _load_gguf_tokenizer(tokenizer_source)
        else:
            loaded = AutoTokenizer.from_pretrained(
                str(tokenizer_source.path), local_files_only=True, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"Cannot load the tokenizer of {tokenizer_source.display_name}: {exc}") from exc
    if not isinstance(loaded, PreTrainedTokenizerFast):
        raise ModelLoadError(
            f"The tokenizer of {tokenizer_source.display_name} loaded as {type(loaded).__name__}, "
            "not a fast (tokenizers-backed) tokenizer; add a tokenizer.json"
        )
    return loaded


def resolve_tokenizer_path(
    tokenizer: str | Path, revision: str | None = None, download_dir: str | Path | None = None
) -> ModelSource:
    """Like ``resolve_model_path``, except that a directory (or hub snapshot) need not hold a config.json."""
    path = Path(tokenizer).expanduser()
    hub_id = HubModelId.parse(str(tokenizer)) if isinstance(tokenizer, str) and not path.exists() else None
    if hub_id is not None and hub_id.quant is None:
        # Tokenizer-only repositories have no config.json: look at the snapshot before deciding the format.
        path = snapshot_path(hub_id, revision, download_dir)
        if not (path / "config.json").exists() and not any(path.glob("*.gguf")):
            return ModelSource(kind="hf", path=path, model_id=hub_id.repo_id, revision=revision)
    if path.is_dir() and not (path / "config.json").exists() and not any(path.glob("*.gguf")):
        return ModelSource(kind="hf", path=path.resolve())
    return resolve_model_path(tokenizer, revision, download_dir)


def _load_gguf_tokenizer(source: ModelSource) -> PreTrainedTokenizerFast:
    """From pagoda's convert cache when it holds this file's tokenizer; converting the GGUF vocabulary takes longer."""
    from transformers import PreTrainedTokenizerFast

    cache = ConvertCache.for_gguf(source.gguf_path)
    cached_dir = cache.tokenizer_dir() if cache is not None else None
    if cached_dir is not None:
        try:
            loaded = PreTrainedTokenizerFast.from_pretrained(str(cached_dir), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the cached tokenizer %s (%s); converting the GGUF vocabulary again", cached_dir, exc)
        else:
            loaded.name_or_path = str(source.path)  # as if loaded from the GGUF file
            return loaded
    # Not AutoTokenizer: for GGUF it re-parses the whole file with gguf.GGUFReader just to pick a
    # class, and picks PreTrainedTokenizerFast anyway (a test checks both give the same tokenizer).
    loaded = PreTrainedTokenizerFast.from_pretrained(str(source.path), gguf_file=source.gguf_file, local_files_only=True)
    if cache is not None and isinstance(loaded, PreTrainedTokenizerFast):
        cache.write_tokenizer(loaded)
    return loaded
