"""A safetensors file written and read one tensor at a time, for the GGUF convert cache.

The format: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes back to back.
Files written here are ordinary safetensors files (``safetensors.safe_open``
reads them); this module exists because the ``safetensors`` library's own API
does not fit either direction of the cache:

- writing: ``save_file`` / ``serialize_file`` take every tensor at once, so the
  conversion would have to hold all dequantized weights beside the model's own
  copy (twice the weights at the first start). Here the header is built from the
  plan (names and shapes, known before the first tensor is converted), and each
  tensor is appended as the loader receives it.
- reading: ``safe_open`` memory-maps the file, and the mapped pages a load
  touches stay in the process's RSS while the file is open, which the start-up
  activation profile on CPU counts against the KV budget. Plain ``readinto`` calls
  into each tensor's own fresh memory hold one tensor at a time, as when converting.
  Measured on the default model in docs/benchmarks.md ("The GGUF convert cache").
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagoda.disk_cache import AtomicFile
from pagoda.model_loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

Plan = list[tuple[str, tuple[int, ...]]]

DTYPE_CODES: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def header(plan: Plan, dtype: torch.dtype, metadata: dict[str, str]) -> tuple[bytes, int]:
    """The file's first bytes (length prefix and JSON header) for ``plan``, and the size of the data after them."""
    code = DTYPE_CODES[dtype]
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in plan:
        nbytes = _ITEMSIZE[code] * math.prod(shape)
        entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offset


class StreamWriter:
    """Appends the tensors of a plan, in order, to a temporary file renamed into place by :meth:`commit`."""

    def __init__(self, path: Path, plan: Plan, dtype: torch.dtype, metadata: dict[str, str]) -> None:
        """Raises ``OSError`` when the file cannot be created."""
        self.path = path
        self.plan = plan
        self.written = 0
        head, _ = header(plan, dtype, metadata)
        self._out = AtomicFile(path, "wb")
        try:
            self._out.file.write(head)
        except BaseException:
            self._out.abandon()
            raise

    def add(self, index: int, name: str, tensor: torch.Tensor) -> bool:
        """Append one tensor; False when it is not the one the header announced, or the write fails."""
        if index >= len(self.plan) or self.plan[index] != (name, tuple(tensor.shape)):
            logger.debug("cache write of %s abandoned: %s does not match its header", self.path, name)
            return False
        try:
            self._out.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", self.path, exc)
            return False
        self.written += 1
        return True

    def commit(self) -> bool:
        """Rename the file into place; False (and no file) when the stream ended early or the rename failed."""
        if self.written != len(self.plan):  # the header promises more tensors than arrived
            self.abandon()
            return False
        try:
            self._out.commit()
        except OSError as exc:
            logger.warning("cannot write the pagoda cache file %s: %s", self.path, exc)
            return False
        return True

    def abandon(self) -> None:
        self._out.abandon()


def check(path: Path, plan: Plan, dtype: torch.dtype, metadata: dict[str, str]) -> str | None:
    """Why the file at ``path`` is not the one :class:`StreamWriter` writes for ``plan``, or None when it is."""
    expected, data_size = header(plan, dtype, metadata)
    try:
        with open(path, "rb") as f:
            head = f.read(len(expected))
        size = path.stat().st_size
    except OSError as exc:
        return f"unreadable: {exc}"
    if head != expected:
        # the same bytes as the header this conversion writes, or it is not our file
        return "its header differs from this GGUF file's conversion (other version, or corrupt)"
    if size != len(expected) + data_size:
        return f"it is {size} bytes, expected {len(expected) + data_size} (truncated?)"
    return None


def read(path: Path, plan: Plan, dtype: torch.dtype, metadata: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a file :func:`check` accepted, read into its own fresh memory, in file order."""
    data_start = len(header(plan, dtype, metadata)[0])
    with open(path, "rb") as f:
        f.seek(data_start)
        for name, shape in plan:
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel():
                buffer = tensor.view(-1).view(torch.uint8).numpy()
                if f.readinto(buffer) != buffer.nbytes:  # type: ignore[arg-type]
                    raise ModelLoadError(f"pagoda cache file {path} ended early at tensor {name}; delete it and retry")
            yield name, tensor
