"""``iter_weights``: a checkpoint's tensors under Hugging Face names, whatever the file format."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Literal, get_args

import torch

from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.gguf.weights import gguf_dtype, iter_gguf
from pagoda.model_loader.hf_weights import iter_pt, iter_safetensors, pt_files, safetensors_files
from pagoda.model_loader.source import ModelSource

LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)


def iter_weights(
    source: ModelSource, load_format: str = "auto", cache_dtype: torch.dtype | None = None,
    keep_quantized: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_param_name, tensor)`` one at a time, streaming from disk.

    ``dummy`` yields nothing: the caller keeps its randomly initialised weights.
    Format problems are raised here, before the first tensor is yielded.
    ``cache_dtype``: the dtype the caller will cast every tensor to. A GGUF
    file's tensors then come cast to it, through pagoda's converted-weights
    cache (see ``convert_cache``); other formats ignore it.
    ``keep_quantized``: for a GGUF file, the layers (by HF parameter name) whose matrices come in
    their stored blocks for the ``gguf`` quantization method (``iter_gguf``).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"Unknown load_format {load_format!r}; expected one of: {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return iter(())

    if source.kind == "gguf":
        if load_format not in ("auto", "gguf"):
            raise ModelLoadError(f"load_format={load_format!r} does not fit {source.display_name}, which is a GGUF file")
        return iter_gguf(source.gguf_path, cache_dtype, keep_quantized)

    if load_format == "gguf":
        raise ModelLoadError(f"load_format='gguf' but {source.path} is a Hugging Face directory, not a .gguf file")
    if load_format in ("auto", "safetensors"):
        files = safetensors_files(source.path)
        if files:
            return iter_safetensors(files)
        if load_format == "safetensors":
            raise ModelLoadError(f"load_format='safetensors' but {source.path} has no .safetensors files")
    files = pt_files(source.path)
    if files:
        return iter_pt(files)
    if load_format == "pt":
        raise ModelLoadError(f"load_format='pt' but {source.path} has no PyTorch .bin/.pt weight files")
    raise ModelLoadError(f"Model directory {source.path} has no weights (no .safetensors, .bin or .pt files)")


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def checkpoint_dtype(source: ModelSource) -> torch.dtype | None:
    """The float type the checkpoint stores its weights in; None when unknown or quantized.

    HF: the ``torch_dtype`` (or newer ``dtype``) entry of config.json. GGUF: the
    type of its weight matrices; a quantized file has no native float type, so
    the engine picks the platform's default.
    """
    if source.kind == "gguf":
        return gguf_dtype(source.gguf_path)
    config_path = source.path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read {config_path}: {exc}") from exc
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str):
        return _DTYPE_NAMES.get(name.removeprefix("torch."))
    return None
