"""An on-disk cache of what pagoda converts out of a GGUF file: weights, config and tokenizer.

Dequantizing a GGUF file, building its config and converting its vocabulary
take seconds at every start. The results are kept under the cache root
(``$PAGODA_CACHE_ROOT``, else ``$XDG_CACHE_HOME/pagoda``, else
``~/.cache/pagoda``; ``PAGODA_DISABLE_CACHE=1`` turns the cache off), one
directory per GGUF file, keyed by its resolved path, size and mtime:

    gguf/<key>/source.json                 which file the entry was made from
    gguf/<key>/weights.<dtype>.safetensors  the dequantized tensors, HF names, cast to <dtype>
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
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.model_loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

CACHE_ROOT_ENV = "PAGODA_CACHE_ROOT"
DISABLE_ENV = "PAGODA_DISABLE_CACHE"
# Bump when what an entry holds changes meaning: older entries are then ignored and rebuilt.
FORMAT_VERSION = 1
# An entry directory with no source.json is a crashed writer's; removed once this old.
_ORPHAN_AGE_S = 3600.0

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
CACHEABLE_DTYPES = frozenset(_SAFETENSORS_DTYPES)


def cache_root() -> Path | None:
    """The cache directory, or None when the cache is disabled."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    configured = os.environ.get(CACHE_ROOT_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagoda"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
            _atomic_write_text(marker, json.dumps(self.source, sort_keys=True))
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
        problem = _check_safetensors(path, plan, _SAFETENSORS_DTYPES[dtype], self._weights_metadata(dtype))
        if problem is not None:
            logger.warning("ignoring the cached weights %s (%s); converting the GGUF file again", path, problem)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        logger.info("reading converted weights from the pagoda cache: %s", path)
        header, _ = _header(plan, _SAFETENSORS_DTYPES[dtype], self._weights_metadata(dtype))
        return _iter_cached(path, plan, dtype, len(header))

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
        writer = _SafetensorsWriter.open(self.weights_path(dtype), plan, _SAFETENSORS_DTYPES[dtype],
                                         self._weights_metadata(dtype))
        try:
            for index, (name, tensor) in enumerate(stream):
                tensor = tensor.to(dtype)
                if writer is not None and not writer.add(index, name, tensor):
                    writer.abandon()
                    writer = None
                yield name, tensor
            if writer is not None:
                writer.commit()
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
            _atomic_write_text(self.directory / "config.json", json.dumps({"stamp": _stamp(), "config": config}))
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
    import transformers

    return {"format": FORMAT_VERSION, "transformers": transformers.__version__}


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


# -- safetensors, written as a stream ------------------------------------------------------
# The format: an 8-byte little-endian header length, a JSON header naming each
# tensor's dtype, shape and byte range, then the tensors' bytes back to back.
# The header is known before the first tensor (the plan), so tensors are
# written as they are converted and never all held at once.


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def _header(plan: list[tuple[str, tuple[int, ...]]], dtype_code: str,
            metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    header: dict[str, Any] = {"__metadata__": metadata}
    ends = []
    offset = 0
    for name, shape in plan:
        nbytes = _ITEMSIZE[dtype_code] * math.prod(shape)
        header[name] = {"dtype": dtype_code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        ends.append(offset)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, ends


@dataclass
class _SafetensorsWriter:
    path: Path
    tmp: Path
    file: Any
    plan: list[tuple[str, tuple[int, ...]]]
    written: int = 0

    @classmethod
    def open(cls, path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype_code: str,
             metadata: dict[str, str]) -> _SafetensorsWriter | None:
        header, _ = _header(plan, dtype_code, metadata)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            file = os.fdopen(fd, "wb")
            file.write(header)
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", path, exc)
            return None
        return cls(path, Path(tmp), file, plan)

    def add(self, index: int, name: str, tensor: torch.Tensor) -> bool:
        """Append one tensor; False when it is not the one the header announced, or the write fails."""
        if index >= len(self.plan) or self.plan[index] != (name, tuple(tensor.shape)):
            logger.debug("cache write of %s abandoned: %s does not match its header", self.path, name)
            return False
        try:
            self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", self.path, exc)
            return False
        self.written += 1
        return True

    def commit(self) -> None:
        if self.written != len(self.plan):  # the stream ended early: the header promises more
            self.abandon()
            return
        try:
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", self.path, exc)
            self.abandon()
            return
        logger.info("cached the converted weights in %s", self.path)

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _check_safetensors(path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype_code: str,
                       metadata: dict[str, str]) -> str | None:
    """Why the file at ``path`` is not the one ``plan`` would write, or None when it is."""
    expected, ends = _header(plan, dtype_code, metadata)
    try:
        with open(path, "rb") as f:
            head = f.read(len(expected))
        size = path.stat().st_size
    except OSError as exc:
        return f"unreadable: {exc}"
    if head != expected:
        # the same bytes as the header this conversion writes, or it is not our file
        return "its header differs from this GGUF file's conversion (other version, or corrupt)"
    total = len(expected) + (ends[-1] if ends else 0)
    if size != total:
        return f"it is {size} bytes, expected {total} (truncated?)"
    return None


def _iter_cached(path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 data_start: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor read into its own fresh memory, in file order.

    Plain reads, not a memory map: a mapped file's pages count towards the
    process's peak RSS, which the start-up activation profile on CPU measures
    against; this way the loader holds one tensor at a time, as when converting.
    """
    with open(path, "rb") as f:
        f.seek(data_start)
        for name, shape in plan:
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():
                buffer = tensor.view(-1).view(torch.uint8).numpy()
                if f.readinto(buffer) != buffer.nbytes:  # type: ignore[arg-type]
                    raise ModelLoadError(f"pagoda cache file {path} ended early at tensor {name}; delete it and retry")
            yield name, tensor
