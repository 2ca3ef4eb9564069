"""Tensors of a GGUF file, dequantized and renamed to Hugging Face parameter names.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``) and, for
llama-architecture models, reorders the rows of the Q and K projections so
rotary embedding pairs sit next to each other. Both are undone here, so the
tensors equal what ``transformers`` loads from the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagoda.model_loader.convert_cache import CACHEABLE_DTYPES, ConvertCache
from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.gguf_file import GGUFFile, GGUFTensorInfo, open_gguf

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


def tensor_to_torch(gguf_file: GGUFFile, tensor: GGUFTensorInfo) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of HF shape: float types as stored, quantized ones as float32."""
    raw = gguf_file.raw_bytes(tensor)
    if tensor.tensor_type == Q.BF16:
        # numpy has no bfloat16: reinterpret the bytes in torch
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(tensor.shape)
    if tensor.tensor_type in FLOAT_TYPES:
        numpy_dtype = np.float32 if tensor.tensor_type == Q.F32 else np.float16
        return torch.from_numpy(raw.view(numpy_dtype).reshape(tensor.shape).copy())
    block_elements, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    row_bytes = tensor.shape[-1] // block_elements * block_bytes
    rows = raw.reshape(-1, row_bytes)  # gguf dequantizes (rows, bytes) into (rows, values)
    return torch.from_numpy(dequantize(rows, tensor.tensor_type)).reshape(tensor.shape)


def _check_supported(gguf_file: GGUFFile, names: ArchitectureNames) -> None:
    """Fail before the first tensor is yielded, not halfway through a load."""
    path = gguf_file.path
    for tensor in gguf_file.tensors:
        tensor_type = tensor.tensor_type
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


def _head_counts(gguf_file: GGUFFile, architecture: str) -> tuple[int, int]:
    num_heads = gguf_file.metadata.get(f"{architecture}.attention.head_count")
    if not isinstance(num_heads, int):
        raise ModelLoadError(f"GGUF file {gguf_file.path} has no {architecture}.attention.head_count in its metadata")
    num_kv_heads = gguf_file.metadata.get(f"{architecture}.attention.head_count_kv")
    return num_heads, num_kv_heads if isinstance(num_kv_heads, int) else num_heads


def iter_gguf(path: Path, cache_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_param_name, tensor)`` for every tensor of the file, one at a time.

    The file is checked (architecture, tensor types and names) before this returns.
    With ``cache_dtype`` (the dtype the caller casts every tensor to) the tensors
    come cast to it, and through pagoda's convert cache when it is on: read from
    it when it holds this file, otherwise dequantized and written to it on the way.
    """
    gguf_file = open_gguf(path)
    architecture = gguf_file.architecture
    names = ARCHITECTURES.get(architecture)
    if names is None:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {architecture!r}; pagoda reads GGUF weights of: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    _check_supported(gguf_file, names)
    num_heads, num_kv_heads = _head_counts(gguf_file, architecture)
    tensors = _dequantized_tensors(gguf_file, names, num_heads, num_kv_heads)
    if cache_dtype is None:
        return tensors
    cache = ConvertCache.for_gguf(path) if cache_dtype in CACHEABLE_DTYPES else None
    if cache is None:
        return ((name, tensor.to(cache_dtype)) for name, tensor in tensors)
    plan = [(name, tensor.shape) for tensor in gguf_file.tensors if (name := hf_name(tensor.name, names)) is not None]
    cached = cache.read_weights(plan, cache_dtype)
    if cached is not None:
        return cached
    return cache.write_weights_through(tensors, plan, cache_dtype)


def _dequantized_tensors(
    gguf_file: GGUFFile, names: ArchitectureNames, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in gguf_file.tensors:
        name = hf_name(tensor.name, names)
        if name is None:
            continue
        weight = tensor_to_torch(gguf_file, tensor)
        if names.permute_qk and ".self_attn.q_proj." in name:
            weight = reverse_qk_permute(weight, num_heads)
        elif names.permute_qk and ".self_attn.k_proj." in name:
            weight = reverse_qk_permute(weight, num_kv_heads)
        yield name, weight


def gguf_dtype(path: Path) -> torch.dtype | None:
    """The float type the file's weight matrices are stored in; None when any is quantized."""
    matrix_types = {t.tensor_type for t in open_gguf(path).tensors if len(t.shape) >= 2}
    if not matrix_types or not matrix_types <= set(FLOAT_TYPES):
        return None
    # Norms stay F32 even in half-precision files, so the narrowest matrix type is the model's.
    for tensor_type in (Q.BF16, Q.F16, Q.F32):
        if tensor_type in matrix_types:
            return FLOAT_TYPES[tensor_type]
    return None
