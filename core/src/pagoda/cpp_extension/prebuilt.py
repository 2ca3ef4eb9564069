"""A copy of the compiled kernel library, keyed by everything it was built from, loaded without torch's JIT.

``load_inline`` costs every fresh process an import of ``torch.utils.cpp_extension``
(a tenth of a second or more), a hash of the sources and a ninja run, even when
nothing changed; and its build directory holds one build per extension name, so
processes built from other sources (or a crashed build's lock file) make the
next start rebuild or wait. After a build the library is copied to
``<pagoda cache root>/torch_extensions/<name>-<key>/``; the key hashes the
sources, flags, torch and Python versions and this CPU (``-march=native``), and
a later start imports that copy directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def build_key(name: str, sources: list[str], build_args: list[list[str]]) -> str:
    import torch

    parts = {
        "name": name,
        "sources": sources,
        "build_args": build_args,
        "torch": [torch.__version__, str(torch.version.git_version)],
        "python": [sys.implementation.cache_tag, platform.machine()],
        "cpu": _cpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _cpu_identity() -> str:
    """The CPU model and feature flags: ``-march=native`` code may not run on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return platform.processor()
    keep = ("vendor_id", "model name", "flags")
    return "\n".join(line for line in lines if line.split(":", 1)[0].strip() in keep)


def _library_path(name: str, key: str) -> Path | None:
    from pagoda.model_loader.convert_cache import cache_root

    root = cache_root()
    if root is None:
        return None
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return root / "torch_extensions" / f"{name}-{key}" / f"{name}{suffix}"


def load_prebuilt(name: str, key: str) -> ModuleType | None:
    """The cached library for ``key``, imported; None when there is none or it does not import."""
    path = _library_path(name, key)
    if path is None or not path.is_file():
        return None
    import torch  # noqa: F401 - the library links against libtorch's symbols

    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        logger.warning("ignoring the cached kernel library %s (%s); building it again", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return module


def store_prebuilt(module: ModuleType, name: str, key: str) -> None:
    """Copy the library ``module`` was loaded from, if it is still that file (another process may rebuild it)."""
    path = _library_path(name, key)
    built = getattr(module, "__file__", None)
    if path is None or built is None:
        return
    loaded_inode = _mapped_inode(built)
    if loaded_inode is None:
        return  # cannot tell that the file on disk is the code in memory
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(built, tmp)
            if os.stat(built).st_ino != loaded_inode:
                return  # rebuilt by someone else meanwhile: the copy may not be what we loaded
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    except OSError as exc:
        logger.debug("kernel library not cached: %s", exc)


def _mapped_inode(path: str) -> int | None:
    """The inode of ``path`` as mapped into this process (Linux), None when not found."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None
