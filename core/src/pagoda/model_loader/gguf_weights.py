"""Tensors of a GGUF file, dequantized and renamed to Hugging Face parameter names.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``) and, for
llama-architecture models, reorders the rows of the Q and K projections so
rotary embedding pairs sit next to each other. Both are undone here, so the
tensors equal what ``transformers`` loads from the same file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from pagoda.model_loader.errors import ModelLoadError

Q = GGMLQuantizationType

# Stored as plain floats: yielded in their own dtype.
FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}
# Stored as blocks: dequantized to float32 by the gguf package.
QUANTIZED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | QUANTIZED_TYPES


@dataclass(frozen=True)
class ArchitectureNames:
    """How one GGUF architecture's tensor names map to Hugging Face names."""

    top_level: dict[str, str]  # GGUF base name -> HF module path
    per_block: dict[str, str]  # GGUF base name inside ``blk.N`` -> HF module path inside ``model.layers.N``
    ignored: frozenset[str]  # GGUF tensors with no HF parameter
    permute_qk: bool  # llama.cpp reorders Q/K rows for rotary pairs


_LLAMA = ArchitectureNames(
    top_level={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    per_block={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    # Llama 3 files store the rope scaling factors; HF recomputes them from config.rope_scaling.
    ignored=frozenset({"rope_freqs.weight"}),
    permute_qk=True,
)

ARCHITECTURES: dict[str, ArchitectureNames] = {"llama": _LLAMA}


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)


def open_gguf(path: Path) -> GGUFReader:
    """A parsed GGUF file, reused within the process: parsing the vocabulary arrays takes seconds."""
    try:
        stat = os.stat(path)
        return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}") from exc


def _field(reader: GGUFReader, key: str) -> object | None:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def gguf_architecture(reader: GGUFReader, path: Path) -> str:
    architecture = _field(reader, "general.architecture")
    if not isinstance(architecture, str):
        raise ModelLoadError(f"GGUF file {path} has no general.architecture in its metadata")
    return architecture


def hf_name(gguf_name: str, names: ArchitectureNames) -> str | None:
    """The HF parameter name of a GGUF tensor; None when it has no HF counterpart; KeyError when unknown."""
    if gguf_name in names.ignored:
        return None
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if base.startswith("blk."):
        _, layer, block_base = base.split(".", 2)
        return f"model.layers.{int(layer)}.{names.per_block[block_base]}.{kind}"
    return f"{names.top_level[base]}.{kind}"


def reverse_qk_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot undo the Q/K permutation: {rows} rows do not split into {num_heads} heads")
    per_half = rows // num_heads // 2
    return weight.reshape(num_heads, per_half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def tensor_to_torch(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in HF (row-major, out x in) shape."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists the fastest-moving dim first
    tensor_type = GGMLQuantizationType(tensor.tensor_type)
    if tensor_type == Q.BF16:
        # numpy has no bfloat16: reinterpret the raw bytes in torch
        raw = torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8))
        return raw.view(torch.bfloat16).reshape(shape)
    if tensor_type in FLOAT_TYPES:
        return torch.from_numpy(np.array(tensor.data, copy=True)).reshape(shape)
    return torch.from_numpy(dequantize(tensor.data, tensor_type)).reshape(shape)


def _check_supported(reader: GGUFReader, path: Path, names: ArchitectureNames) -> None:
    """Fail before the first tensor is yielded, not halfway through a load."""
    for tensor in reader.tensors:
        tensor_type = GGMLQuantizationType(tensor.tensor_type)
        if tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise ModelLoadError(
                f"GGUF file {path}: tensor {tensor.name} has type {tensor_type.name}, which pagoda cannot "
                f"dequantize (supported: {supported})"
            )
        try:
            hf_name(tensor.name, names)
        except (KeyError, ValueError):
            raise ModelLoadError(f"GGUF file {path}: tensor {tensor.name} has no known Hugging Face name") from None


def _head_counts(reader: GGUFReader, architecture: str, path: Path) -> tuple[int, int]:
    num_heads = _field(reader, f"{architecture}.attention.head_count")
    if not isinstance(num_heads, int):
        raise ModelLoadError(f"GGUF file {path} has no {architecture}.attention.head_count in its metadata")
    num_kv_heads = _field(reader, f"{architecture}.attention.head_count_kv")
    return num_heads, num_kv_heads if isinstance(num_kv_heads, int) else num_heads


def iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_param_name, tensor)`` for every tensor of the file, one at a time.

    The file is checked (architecture, tensor types and names) before this returns.
    """
    reader = open_gguf(path)
    architecture = gguf_architecture(reader, path)
    names = ARCHITECTURES.get(architecture)
    if names is None:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {architecture!r}; pagoda reads GGUF weights of: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    _check_supported(reader, path, names)
    num_heads, num_kv_heads = _head_counts(reader, architecture, path)
    return _dequantized_tensors(reader, names, num_heads, num_kv_heads)


def _dequantized_tensors(
    reader: GGUFReader, names: ArchitectureNames, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in reader.tensors:
        name = hf_name(tensor.name, names)
        if name is None:
            continue
        weight = tensor_to_torch(tensor)
        if names.permute_qk and ".self_attn.q_proj." in name:
            weight = reverse_qk_permute(weight, num_heads)
        elif names.permute_qk and ".self_attn.k_proj." in name:
            weight = reverse_qk_permute(weight, num_kv_heads)
        yield name, weight


def gguf_dtype(path: Path) -> torch.dtype | None:
    """The float type the file's weight matrices are stored in; None when any is quantized."""
    reader = open_gguf(path)
    matrix_types = {GGMLQuantizationType(t.tensor_type) for t in reader.tensors if len(t.shape) >= 2}
    if not matrix_types or not matrix_types <= set(FLOAT_TYPES):
        return None
    # Norms stay F32 even in half-precision files, so the narrowest matrix type is the model's.
    for tensor_type in (Q.BF16, Q.F16, Q.F32):
        if tensor_type in matrix_types:
            return FLOAT_TYPES[tensor_type]
    return None
