"""pagoda's on-disk cache: where it lives, and writing into it so that no reader sees a partial file.

Everything pagoda keeps between runs (GGUF conversions, compiled kernel
libraries) goes under one root: ``$PAGODA_CACHE_ROOT``, else
``$XDG_CACHE_HOME/pagoda``, else ``~/.cache/pagoda``; ``PAGODA_DISABLE_CACHE=1``
turns the cache off. Several processes may fill the same entry at once, so a
file is written under a temporary name in its final directory and renamed over
the final name only when complete (a rename within one filesystem is atomic).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Any

from pagoda import envs

CACHE_ROOT_ENV = "PAGODA_CACHE_ROOT"
DISABLE_ENV = "PAGODA_DISABLE_CACHE"


def cache_root() -> Path | None:
    """The cache directory, or None when the cache is disabled."""
    if envs.PAGODA_DISABLE_CACHE:
        return None
    configured = envs.PAGODA_CACHE_ROOT
    if configured is not None:
        return configured
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagoda"


def _temporary_sibling(path: Path) -> tuple[int, Path]:
    # Same directory as the target: os.replace is atomic only within one filesystem.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    return fd, Path(tmp)


class AtomicFile:
    """A file written under a temporary name beside ``path``, renamed over ``path`` by :meth:`commit`.

    :meth:`abandon` (or leaving a ``with`` block by an exception) removes the
    temporary file and leaves ``path`` as it was. Opening raises ``OSError``
    when the directory is not writable.
    """

    def __init__(self, path: Path, mode: str = "wb") -> None:
        if "w" not in mode:
            raise ValueError(f"AtomicFile writes a new file; mode {mode!r} has no 'w'")
        self.path = path
        fd, self.tmp = _temporary_sibling(path)
        try:
            self.file: IO[Any] = os.fdopen(fd, mode)
        except BaseException:
            os.close(fd)
            self._remove_tmp()
            raise
        self._done = False

    def commit(self) -> None:
        """Close the file and rename it into place; on ``OSError`` nothing is left behind and the error is raised."""
        if self._done:
            raise RuntimeError(f"{self.path}: the temporary file was already committed or abandoned")
        self._done = True
        try:
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self._remove_tmp()
            raise

    def abandon(self) -> None:
        """Close and delete the temporary file; ``path`` is untouched. Safe to call more than once."""
        self._done = True
        with contextlib.suppress(OSError):
            self.file.close()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        with contextlib.suppress(OSError):
            self.tmp.unlink()

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abandon()
        elif not self._done:
            self.commit()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place."""
    with AtomicFile(path, "w") as out:
        out.file.write(text)

