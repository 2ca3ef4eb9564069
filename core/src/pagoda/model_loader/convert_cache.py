"""An on-disk cache of what pagoda converts out of a GGUF file: weights, config and tokenizer.

Dequantizing a GGUF file, building its config and converting its vocabulary
take seconds at every start. The results are kept under pagoda's cache root
(``pagoda.disk_cache``: ``$PAGODA_CACHE_ROOT``, else ``$XDG_CACHE_HOME/pagoda``,
else ``~/.cache/pagoda``; ``PAGODA_DISABLE_CACHE=1`` turns the cache off), one
directory per GGUF file, keyed by its resolved path, size and mtime:

    gguf/<key>/source.json                 which file the entry was made from
    gguf/<key>/weights.<dtype>.safetensors  the dequantized tensors, HF names, cast to <dtype>
                                           (written and read as a stream: ``safetensors_stream``)
    gguf/<key>/config.json                 the transformers config (``to_dict``)
    gguf/<key>/tokenizer/                  the fast tokenizer (``save_pretrained``)

Every file is written under a temporary name and renamed into place, so a
reader never sees a partial file; a file that fails its checks (truncated,
other source or format) is ignored and rebuilt. Any problem with the cache
itself (unwritable directory, full disk) costs only the speed-up: the caller
falls back to converting the GGUF file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.disk_cache import atomic_write_text, cache_root
from pagoda.model_loader import safetensors_stream

logger = logging.getLogger(__name__)

# Bump when what an entry holds changes meaning: older entries are then ignored and rebuilt.
# 2: configs of non-llama GGUF files are pagoda's (keys transformers drops, e.g. Qwen3's head size).
FORMAT_VERSION = 2
# An entry directory with no source.json is a crashed writer's; removed once this old.
_ORPHAN_AGE_S = 3600.0

CACHEABLE_DTYPES = frozenset(safetensors_stream.DTYPE_CODES)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ConvertCache:
    """The cache entry of one GGUF file (as it is now: another size or mtime is another entry)."""

    directory: Path
    source: dict[str, Any]  # path, size, mtime_ns, format

    @classmethod
    def for_gguf(cls, gguf_path: Path) -> ConvertCache | None:
        """The entry for ``gguf_path``; None when the cache is disabled or the file cannot be stat'ed."""
        root = cache_root()
        if root is None:
            return None
        try:
            resolved = gguf_path.resolve()
            stat = resolved.stat()
        except OSError:
            return None
        source = {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": FORMAT_VERSION}
        key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:32]
        return cls(directory=root / "gguf" / key, source=source)

    # -- the entry directory ----------------------------------------------------
    def _prepare(self) -> bool:
        """Create the entry directory (pruning stale entries when it is new); False when it cannot be written."""
        marker = self.directory / "source.json"
        if marker.is_file():
            return True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(marker, json.dumps(self.source, sort_keys=True))
        except OSError as exc:
            logger.warning("pagoda cache %s is not writable (%s): converting without caching", self.directory, exc)
            return False
        prune_stale_entries(self.directory.parent, keep=self.directory)
        return True

    # -- weights ---------------------------------------------------------------------
    def weights_path(self, dtype: torch.dtype) -> Path:
        return self.directory / f"weights.{_dtype_name(dtype)}.safetensors"

    def _weights_metadata(self, dtype: torch.dtype) -> dict[str, str]:
        return {
            "pagoda_format": str(FORMAT_VERSION),
            "source_size": str(self.source["size"]),
            "source_mtime_ns": str(self.source["mtime_ns"]),
            "dtype": _dtype_name(dtype),
        }

    def read_weights(
        self, plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The cached tensors of ``plan`` (names and shapes, in order), or None when there is no valid file.

        A file that exists but fails a check is deleted, so the caller's rebuild replaces it.
        """
        path = self.weights_path(dtype)
        if not path.is_file():
            return None
        problem = safetensors_stream.check(path, plan, dtype, self._weights_metadata(dtype))
        if problem is not None:
            logger.warning("ignoring the cached weights %s (%s); converting the GGUF file again", path, problem)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        logger.info("reading converted weights from the pagoda cache: %s", path)
        return safetensors_stream.read(path, plan, dtype, self._weights_metadata(dtype))

    def write_weights_through(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        plan: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``stream``'s tensors cast to ``dtype`` while writing them to the cache.

        The file is renamed into place only once every tensor of ``plan`` went
        through; a consumer that stops early or fails leaves no file behind.
        """
        if not self._prepare():
            yield from ((name, tensor.to(dtype)) for name, tensor in stream)
            return
        path = self.weights_path(dtype)
        writer: safetensors_stream.StreamWriter | None
        try:
            writer = safetensors_stream.StreamWriter(path, plan, dtype, self._weights_metadata(dtype))
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", path, exc)
            writer = None
        try:
            for index, (name, tensor) in enumerate(stream):
                tensor = tensor.to(dtype)
                if writer is not None and not writer.add(index, name, tensor):
                    writer.abandon()
                    writer = None
                yield name, tensor
            if writer is not None:
                if writer.commit():
                    logger.info("cached the converted weights in %s", path)
                writer = None
        finally:
            if writer is not None:
                writer.abandon()

    # -- config and tokenizer ----------------------------------------------------------
    def read_config(self) -> dict[str, Any] | None:
        """The cached config dict, when it was written by this transformers version."""
        path = self.directory / "config.json"
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the cached config %s (%s)", path, exc)
            return None
        if not isinstance(stored, dict) or stored.get("stamp") != _stamp() or not isinstance(stored.get("config"), dict):
            return None
        return stored["config"]

    def write_config(self, config: dict[str, Any]) -> None:
        if not self._prepare():
            return
        try:
            atomic_write_text(self.directory / "config.json", json.dumps({"stamp": _stamp(), "config": config}))
        except (OSError, TypeError, ValueError) as exc:  # TypeError: a value json cannot encode
            logger.warning("cannot cache the config of %s: %s", self.source["path"], exc)

    def tokenizer_dir(self) -> Path | None:
        """The cached tokenizer directory, when complete and written by this transformers version."""
        directory = self.directory / "tokenizer"
        try:
            stamp = json.loads((directory / "pagoda_stamp.json").read_text())
        except (OSError, ValueError):
            return None
        return directory if stamp == _stamp() else None

    def write_tokenizer(self, tokenizer: Any) -> None:
        """``tokenizer.save_pretrained`` into a temporary directory, renamed into place when complete."""
        if not self._prepare():
            return
        final = self.directory / "tokenizer"
        try:
            tmp = Path(tempfile.mkdtemp(dir=self.directory, prefix=".tokenizer.", suffix=".tmp"))
        except OSError as exc:
            logger.warning("cannot cache the tokenizer of %s: %s", self.source["path"], exc)
            return
        try:
            tokenizer.save_pretrained(str(tmp))
            (tmp / "pagoda_stamp.json").write_text(json.dumps(_stamp()))
            if final.exists():
                if self.tokenizer_dir() is not None:
                    return  # a concurrent writer's, as good as ours
                shutil.rmtree(final, ignore_errors=True)  # stale: another transformers version's
            os.replace(tmp, final)
        except OSError as exc:
            # ENOTEMPTY: another process renamed its copy in first
            logger.debug("tokenizer cache of %s not written: %s", self.source["path"], exc)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _stamp() -> dict[str, Any]:
    """What a cached config or tokenizer depends on besides the GGUF file."""
    return {"format": FORMAT_VERSION, "transformers": _transformers_version()}


def _transformers_version() -> str:
    # Read from the installed distribution: importing transformers for its __version__ cost 1.2-1.4 s
    # of the API process's config phase, on the path to /health, where nothing else needs it yet.
    loaded = sys.modules.get("transformers")
    if loaded is not None:
        return str(loaded.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:  # an unusual install (no dist-info): ask the module
        import transformers

        return str(transformers.__version__)


def prune_stale_entries(gguf_root: Path, keep: Path) -> None:
    """Remove entries whose GGUF file is gone or changed, so the cache does not grow with every edit."""
    try:
        entries = list(gguf_root.iterdir())
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if entry == keep or not entry.is_dir():
            continue
        try:
            source = json.loads((entry / "source.json").read_text())
            stat = os.stat(source["path"])
            stale = (stat.st_size, stat.st_mtime_ns) != (source["size"], source["mtime_ns"]) or source.get(
                "format") != FORMAT_VERSION
        except FileNotFoundError as exc:
            # the GGUF file is gone, or the entry never got its source.json (a writer crashed)
            stale = exc.filename != str(entry / "source.json") or _older_than(entry, now, _ORPHAN_AGE_S)
        except (OSError, ValueError, KeyError, TypeError):
            stale = _older_than(entry, now, _ORPHAN_AGE_S)
        if stale:
            logger.info("removing stale pagoda cache entry %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _older_than(path: Path, now: float, seconds: float) -> bool:
    try:
        return now - path.stat().st_mtime > seconds
    except OSError:
        return False
