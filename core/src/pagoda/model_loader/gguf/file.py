"""A lean GGUF reader: metadata and tensor table from a memory map, tensor bytes on demand.

``gguf.GGUFReader`` builds a numpy view for every string of the vocabulary and
merge tables, which takes seconds for a 49k-token model. Weights need none of
them, so this reader walks past string arrays (keeping their length) and
parses the rest; dequantization is still the ``gguf`` package's.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagoda.model_loader.errors import ModelLoadError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent
_STRING, _ARRAY = 8, 9
# GGUF metadata value type -> struct format of the fixed-size scalars
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class SkippedStrings:
    """A string array this reader walked past (vocabulary, merges): only its length is kept."""

    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (torch) order; ggml lists the fastest-moving dimension first
    tensor_type: GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, object]
    tensors: tuple[GGUFTensorInfo, ...]
    blob: np.memmap

    def raw_bytes(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored bytes (a read-only view of the memory map)."""
        return self.blob[tensor.start : tensor.start + tensor.nbytes]

    @property
    def architecture(self) -> str:
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise ModelLoadError(f"GGUF file {self.path} has no general.architecture in its metadata")
        return architecture


class _Cursor:
    def __init__(self, blob: np.memmap, path: Path) -> None:
        self.blob = blob.data  # a memoryview: what struct.unpack_from wants
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self.blob, self.pos)
        except struct.error:
            raise ModelLoadError(f"GGUF file {self.path} is truncated (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        raw = self.blob[self.pos : self.pos + length].tobytes()
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> object:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                values = np.frombuffer(self.blob, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            if item_type == _STRING:
                for _ in range(count):
                    (length,) = struct.unpack_from("<Q", self.blob, self.pos)
                    self.pos += 8 + length
                return SkippedStrings(count)
            return [self.value(item_type) for _ in range(count)]  # nested arrays: rare and small
        raise ModelLoadError(f"GGUF file {self.path} has metadata of unknown value type {value_type}")


def _tensor_type(type_id: int, name: str, path: Path) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(f"GGUF file {path}: tensor {name} has unknown ggml type id {type_id}") from None


def _nbytes(tensor_type: GGMLQuantizationType, shape: tuple[int, ...], name: str, path: Path) -> int:
    if tensor_type not in GGML_QUANT_SIZES:
        raise ModelLoadError(f"GGUF file {path}: tensor {name} has ggml type {tensor_type.name} of unknown size")
    block_elements, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if shape and shape[-1] % block_elements:
        raise ModelLoadError(
            f"GGUF file {path}: tensor {name} has rows of {shape[-1]} values, not a multiple of "
            f"{tensor_type.name}'s block of {block_elements}"
        )
    return math.prod(shape) // block_elements * block_bytes


def parse_gguf(path: Path) -> GGUFFile:
    try:
        blob = np.memmap(path, mode="r", dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}") from exc
    if bytes(blob[:4]) != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    cursor = _Cursor(blob, path)
    cursor.pos = 4
    version, tensor_count, metadata_count = cursor.unpack("<IQQ")
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(
            f"GGUF file {path} has version {version}; pagoda reads little-endian GGUF version 2 and 3"
        )

    metadata: dict[str, object] = {}
    for _ in range(metadata_count):
        key = cursor.string()
        (value_type,) = cursor.unpack("<I")
        metadata[key] = cursor.value(value_type)

    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        (ndim,) = cursor.unpack("<I")
        dims = cursor.unpack(f"<{ndim}Q")
        type_id, offset = cursor.unpack("<IQ")
        table.append((name, tuple(int(d) for d in reversed(dims)), type_id, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelLoadError(f"GGUF file {path} has an invalid general.alignment {alignment!r}")
    data_start = -(-cursor.pos // alignment) * alignment

    tensors = []
    for name, shape, type_id, offset in table:
        tensor_type = _tensor_type(type_id, name, path)
        tensor = GGUFTensorInfo(name, shape, tensor_type, data_start + offset, _nbytes(tensor_type, shape, name, path))
        if tensor.start + tensor.nbytes > blob.size:
            raise ModelLoadError(f"GGUF file {path} is truncated: tensor {name} runs past the end of the file")
        tensors.append(tensor)
    return GGUFFile(path=path, metadata=metadata, tensors=tuple(tensors), blob=blob)


@functools.lru_cache(maxsize=2)
def _cached_parse(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return parse_gguf(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, reused within the process while the file is unchanged."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}") from exc
    return _cached_parse(str(path), stat.st_mtime_ns, stat.st_size)
