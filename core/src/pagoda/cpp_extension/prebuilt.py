"""The cached copy of a compiled kernel library, keyed by everything it was built from.

A library is compiled once per machine and kept at
``<pagoda cache root>/cpp_extensions/<name>-<key>/lib<name>.so``; the key hashes the sources
and every header they may include, the flags, the compiler, the OpenMP runtime it links and
this CPU (``-march=native`` code may not run on another one), so a later process loads that
file directly and a change to any input builds a new one beside it. A library is published by
an atomic rename, so a process never loads a half-written file. A build holds an exclusive lock
on ``<name>-<key>/build.lock`` (``flock``): a second process asking for the same key meanwhile
(``pagoda serve``'s API process starts the attention kernel's build early, and its engine-core
process asks for the same library seconds later) waits for it and loads the first one's library
instead of compiling the same sources again beside it on the same cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "cpp_extensions"
LOCK_NAME = "build.lock"


def build_key(name: str, sources: list[str], build_args: list[list[str]]) -> str:
    """A hash of the library's name, source texts (headers included) and build arguments, and this CPU."""
    parts = {
        "name": name,
        "sources": sources,
        "build_args": build_args,
        "machine": platform.machine(),
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
    from pagoda.disk_cache import cache_root

    root = cache_root()
    if root is None:
        return None
    return root / CACHE_SUBDIR / f"{name}-{key}" / f"lib{name}.so"


def library_path(name: str, key: str) -> Path | None:
    """Where the library for ``key`` is cached; None when the cache is disabled."""
    return _library_path(name, key)


def load_library(name: str, path: Path) -> ModuleType:
    """Import the library at ``path`` as the Python extension module ``name`` (see pagoda/python.h)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path} as {name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_prebuilt(name: str, key: str) -> ModuleType | None:
    """The cached library for ``key``, loaded; None when there is none or it does not load (it is removed then)."""
    path = _library_path(name, key)
    if path is None or not path.is_file():
        return None
    try:
        return load_library(name, path)
    except (ImportError, OSError) as exc:
        logger.warning("ignoring the cached kernel library %s (%s); building it again", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def publish(built: Path, name: str, key: str) -> Path | None:
    """Move the freshly built library ``built`` to its cache path (atomically); None when the cache is disabled or not writable."""
    path = _library_path(name, key)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(built, path)
    except OSError as exc:
        logger.debug("kernel library not cached: %s", exc)
        return None
    return path


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[float]:
    """Hold the exclusive build lock of one cached library's folder; yields the seconds spent waiting for it.

    ``flock`` is released by the kernel when its holder exits, so a build killed half-way never
    leaves the key locked. Where the file system refuses the lock, the build goes on unlocked
    (as before the lock: at worst two processes compile the same library).
    """
    started = time.perf_counter()
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        logger.debug("kernel library build not locked: %s", exc)
        yield 0.0
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.perf_counter() - started
    finally:
        os.close(fd)  # closing the only descriptor releases the lock
