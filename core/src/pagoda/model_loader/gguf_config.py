"""A transformers config from GGUF metadata, read by pagoda's lean GGUF parser.

``AutoConfig.from_pretrained(dir, gguf_file=...)`` parses the whole file with
``gguf.GGUFReader`` (seconds, for the vocabulary it then ignores). For the
architectures listed here the same config is built from transformers' own
GGUF-key table and pagoda's parser; a test checks both give equal configs.
Any other architecture goes through transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pagoda.model_loader.gguf_file import SkippedStrings, open_gguf

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Architectures whose transformers GGUF config is a plain key rename (no special cases in transformers).
FAST_CONFIG_ARCHITECTURES = frozenset({"llama"})


def gguf_config_dict(path: Path) -> dict[str, object] | None:
    """The config dict transformers would build, or None when this architecture needs transformers' own path."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    gguf_file = open_gguf(path)
    metadata = gguf_file.metadata
    architecture = gguf_file.architecture
    name = metadata.get("general.name")
    # transformers reads a llama-architecture file named "mistral" as Mistral
    if architecture not in FAST_CONFIG_ARCHITECTURES or (isinstance(name, str) and "mistral" in name):
        return None

    config: dict[str, object] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in gguf_file.tensors),
    }
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renames = cast("dict[str, Any] | None", GGUF_CONFIG_MAPPING.get(prefix))
        if renames is None or rest not in renames:
            continue
        hf_key = renames[rest]
        if hf_key is None or hf_key == -1 or isinstance(value, SkippedStrings):
            continue
        config[hf_key] = value
    if "vocab_size" not in config:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, SkippedStrings):
            config["vocab_size"] = tokens.count
    return config


def load_gguf_config(path: Path) -> PretrainedConfig | None:
    from transformers import CONFIG_MAPPING

    config_dict = gguf_config_dict(path)
    if config_dict is None:
        return None
    config = CONFIG_MAPPING[str(config_dict["model_type"])].from_dict(config_dict)
    config.name_or_path = str(path.parent)  # as transformers sets it
    return config
