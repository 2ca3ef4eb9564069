"""Tensors of a GGUF file, dequantized and renamed to Hugging Face parameter names.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight``, names in
``names``) and changes a few layouts per architecture: Llama's Q and K rows
reordered for its rotary kernel, Gemma's norm weights stored as ``1 + w``,
GPT-2's Conv1D matrices transposed, GPT-NeoX's fused QKV regrouped, MoE experts
split per projection. All are undone here, so the tensors equal what
``transformers`` loads from the same file.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from gguf.quants import dequantize

from pagoda.model_loader.convert_cache import CACHEABLE_DTYPES, ConvertCache
from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.gguf.file import GGUFFile, GGUFTensorInfo, open_gguf
from pagoda.model_loader.gguf.names import (
    ARCHITECTURES,
    GGUFArchitecture,
    TensorRole,
    hf_parameter,
    names_for,
    tensor_role,
)

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
# The RMSNorm weights llama.cpp stores as 1 + w for Gemma
_NORM_KINDS = frozenset({
    MODEL_TENSOR.OUTPUT_NORM, MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_POST_NORM, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.FFN_PRE_NORM,
    MODEL_TENSOR.FFN_POST_NORM, MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM,
})


@dataclass(frozen=True)
class Conversion:
    """One step of the load: GGUF tensors in, HF-named tensors out (usually one of each)."""

    sources: tuple[GGUFTensorInfo, ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]  # HF name and shape of every tensor it yields
    op: str  # "rename", "fuse_rows", "fuse_experts", "split_qkv"
    role: TensorRole


def plan_conversions(gguf_file: GGUFFile, arch: GGUFArchitecture) -> list[Conversion]:
    """Every HF tensor the file yields, in file order; ModelLoadError naming the first tensor with no HF name."""
    path = gguf_file.path
    present = {role.kind for t in gguf_file.tensors if (role := tensor_role(arch.name, t.name)) is not None}
    arch = names_for(arch, present)
    fused_kinds = {kind: fused for fused in arch.fused for kind in fused.kinds}
    groups: dict[tuple[int | None, str, str], list[tuple[MODEL_TENSOR, GGUFTensorInfo]]] = {}
    conversions: list[Conversion] = []
    for tensor in gguf_file.tensors:
        role = tensor_role(arch.name, tensor.name)
        if role is not None and role.kind in (MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT):
            # transformers drops them and runs without LongRoPE; pagoda does not rebuild rope_scaling
            raise ModelLoadError(
                f"GGUF file {path} stores LongRoPE factors ({tensor.name}); pagoda does not rebuild a LongRoPE "
                "config from a GGUF file: load the Hugging Face checkpoint instead"
            )
        if role is None or (
            role.kind not in arch.names and role.kind not in fused_kinds
            and role.kind not in arch.ignored and role.kind not in arch.split_qkv
        ):
            raise ModelLoadError(
                f"GGUF file {path}: tensor {tensor.name} has no known Hugging Face name for architecture {arch.name!r}"
            )
        if role.kind in arch.ignored:
            continue
        if role.kind in arch.split_qkv:
            rows = tensor.shape[0] // 3
            names = tuple(hf_parameter(arch, role, module) for module in arch.split_qkv[role.kind])
            outputs = tuple((name, (rows, *tensor.shape[1:])) for name in names)
            conversions.append(Conversion((tensor,), outputs, "split_qkv", role))
        elif role.kind in fused_kinds:
            fused = fused_kinds[role.kind]
            key = (role.block, fused.hf_name, role.suffix)
            members = groups.setdefault(key, [])
            members.append((role.kind, tensor))
            if len(members) == len(fused.kinds):
                ordered = tuple(t for kind in fused.kinds for k, t in members if k == kind)
                conversions.append(_fused_conversion(arch, role, fused.hf_name, fused.how, ordered))
        else:
            shape = tensor.shape
            if role.kind in arch.transposed and len(shape) == 2:
                shape = (shape[1], shape[0])
            elif role.kind == MODEL_TENSOR.FFN_GATE_INP_SHEXP and len(shape) == 1:
                shape = (1, *shape)  # llama.cpp squeezes the [1, hidden] gate
            conversions.append(Conversion((tensor,), ((hf_parameter(arch, role, arch.names[role.kind]), shape),),
                                          "rename", role))
    for (block, hf_module, _suffix), members in groups.items():
        fused = next(f for f in arch.fused if f.hf_name == hf_module)
        if len(members) != len(fused.kinds):
            missing = [TENSOR_NAMES[k].format(bid=block) for k in fused.kinds if k not in {m[0] for m in members}]
            raise ModelLoadError(f"GGUF file {path} has {members[0][1].name} but not {', '.join(missing)}")
    return conversions


def _fused_conversion(
    arch: GGUFArchitecture, role: TensorRole, hf_module: str, how: str, sources: tuple[GGUFTensorInfo, ...]
) -> Conversion:
    first = sources[0].shape
    if how == "fuse_rows":
        shape = (sum(t.shape[0] for t in sources), *first[1:])
        name = f"{arch.layer_prefix}.{role.block}.{hf_module}.{role.suffix}"
    else:  # stacked experts [E, rows, cols] (a bare parameter in transformers 5), concatenated on the rows
        shape = (first[0], sum(t.shape[1] for t in sources), *first[2:])
        name = f"{arch.layer_prefix}.{role.block}.{hf_module}"
    return Conversion(sources, ((name, shape),), how, role)


def reverse_qk_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot undo the Q/K permutation: {rows} rows do not split into {num_heads} heads")
    per_half = rows // num_heads // 2
    return weight.reshape(num_heads, per_half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def reverse_neox_qkv(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's GPT-NeoX QKV order: all q, all k, all v -> per head [q, k, v] (HF's)."""
    rows = weight.shape[0]
    if rows % (3 * num_heads):
        raise ModelLoadError(f"cannot regroup the fused QKV: {rows} rows do not split into 3 x {num_heads} heads")
    head_dim = rows // 3 // num_heads
    return weight.reshape(3, num_heads, head_dim, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def reverse_falcon_qkv(weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Falcon QKV order: all q, all k, all v -> per KV group [q..., k, v] (HF's).

    One KV group (Falcon 7B's multi-query) is the identity; as many groups as heads is the
    per-head [q, k, v] of multi-head Falcon.
    """
    rows = weight.shape[0]
    if num_heads % num_kv_heads or rows % (num_heads + 2 * num_kv_heads):
        raise ModelLoadError(f"cannot regroup Falcon's fused QKV: {rows} rows, {num_heads} heads, {num_kv_heads} KV heads")
    head_dim = rows // (num_heads + 2 * num_kv_heads)
    rest = weight.shape[1:]
    q, k, v = weight.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    groups = [
        q.reshape(num_kv_heads, num_heads // num_kv_heads, head_dim, *rest),
        k.reshape(num_kv_heads, 1, head_dim, *rest),
        v.reshape(num_kv_heads, 1, head_dim, *rest),
    ]
    return torch.cat(groups, dim=1).reshape(weight.shape)


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


def _check_types(gguf_file: GGUFFile) -> None:
    """Fail before the first tensor is yielded, not halfway through a load."""
    for tensor in gguf_file.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise ModelLoadError(
                f"GGUF file {gguf_file.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which pagoda "
                f"cannot dequantize (supported: {supported})"
            )


def _head_counts(gguf_file: GGUFFile, architecture: str) -> tuple[int, int]:
    num_heads = gguf_file.metadata.get(f"{architecture}.attention.head_count")
    if not isinstance(num_heads, int):
        raise ModelLoadError(f"GGUF file {gguf_file.path} has no {architecture}.attention.head_count in its metadata")
    num_kv_heads = gguf_file.metadata.get(f"{architecture}.attention.head_count_kv")
    return num_heads, num_kv_heads if isinstance(num_kv_heads, int) else num_heads


def iter_gguf(
    path: Path, cache_dtype: torch.dtype | None = None, keep_quantized: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_param_name, tensor)`` for every tensor of the file, one at a time.

    The file is checked (architecture, tensor types and names) before this returns.
    ``keep_quantized(hf_name)``: the tensors of layers that hold GGUF blocks themselves (the
    ``gguf`` quantization method); each such matrix comes as it is stored, as vLLM's GGUF loader
    yields it: ``<layer>.qweight_type`` (the GGML type id) then ``<layer>.qweight`` (uint8
    [rows, bytes per row]; the row transforms below apply to whole rows of blocks).
    With ``cache_dtype`` (the dtype the caller casts every tensor to) the tensors
    come cast to it, and through pagoda's convert cache when it is on: read from
    it when it holds this file, otherwise dequantized and written to it on the way.
    """
    gguf_file = open_gguf(path)
    architecture = gguf_file.architecture
    arch = ARCHITECTURES.get(architecture)
    if arch is None:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {architecture!r}; pagoda reads GGUF weights of: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    _check_types(gguf_file)
    conversions = plan_conversions(gguf_file, arch)
    num_heads, num_kv_heads = _head_counts(gguf_file, architecture)
    tensors = _dequantized_tensors(gguf_file, arch, conversions, num_heads, num_kv_heads, keep_quantized)
    if cache_dtype is None or keep_quantized is not None:
        return tensors
    cache = ConvertCache.for_gguf(path) if cache_dtype in CACHEABLE_DTYPES else None
    if cache is None:
        return ((name, tensor.to(cache_dtype)) for name, tensor in tensors)
    plan = [output for conversion in conversions for output in conversion.outputs]
    cached = cache.read_weights(plan, cache_dtype)
    if cached is not None:
        return cached
    return cache.write_weights_through(tensors, plan, cache_dtype)


def tensor_blocks(gguf_file: GGUFFile, tensor: GGUFTensorInfo) -> torch.Tensor:
    """A 2-D tensor's stored bytes, one row of blocks (or of floats) per output row: uint8 [rows, bytes per row]."""
    raw = gguf_file.raw_bytes(tensor)
    return torch.from_numpy(raw.copy()).reshape(tensor.shape[0], -1)


def _stored_as_blocks(conversion: Conversion, keep_quantized: Callable[[str], bool] | None) -> bool:
    """Whether a conversion's output stays in its stored form: a 2-D matrix of a layer that
    keeps GGUF blocks, whose conversion only moves whole rows."""
    if keep_quantized is None or conversion.op not in ("rename", "fuse_rows", "split_qkv"):
        return False
    if any(len(t.shape) != 2 for t in conversion.sources):
        return False
    if conversion.op == "fuse_rows" and len({t.tensor_type for t in conversion.sources}) != 1:
        return False
    return all(keep_quantized(name) and len(shape) == 2 for name, shape in conversion.outputs)


def _as_stored(name: str, tensor_type: GGMLQuantizationType, blocks: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    layer = name.removesuffix(".weight")
    yield f"{layer}.qweight_type", torch.tensor(int(tensor_type), dtype=torch.int64)
    yield f"{layer}.qweight", blocks


def _dequantized_tensors(
    gguf_file: GGUFFile, arch: GGUFArchitecture, conversions: list[Conversion], num_heads: int, num_kv_heads: int,
    keep_quantized: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    for conversion in conversions:
        kind = conversion.role.kind
        if _stored_as_blocks(conversion, keep_quantized):
            tensor_type = conversion.sources[0].tensor_type
            parts = [tensor_blocks(gguf_file, t) for t in conversion.sources]
            blocks = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if conversion.op == "split_qkv":
                for (name, _), part in zip(conversion.outputs, blocks.chunk(3, dim=0)):
                    yield from _as_stored(name, tensor_type, part.contiguous())
                continue
            if arch.permute_qk and kind == MODEL_TENSOR.ATTN_Q:
                blocks = reverse_qk_permute(blocks, num_heads)
            elif arch.permute_qk and kind == MODEL_TENSOR.ATTN_K:
                blocks = reverse_qk_permute(blocks, num_kv_heads)
            elif arch.regroup_neox_qkv and kind == MODEL_TENSOR.ATTN_QKV:
                blocks = reverse_neox_qkv(blocks, num_heads)
            elif arch.regroup_falcon_qkv and kind == MODEL_TENSOR.ATTN_QKV:
                blocks = reverse_falcon_qkv(blocks, num_heads, num_kv_heads)
            elif kind in arch.transposed:
                raise ModelLoadError(f"GGUF tensor {conversion.sources[0].name} is stored transposed: it cannot stay in blocks")
            yield from _as_stored(conversion.outputs[0][0], tensor_type, blocks.contiguous())
            continue
        weights = [tensor_to_torch(gguf_file, tensor) for tensor in conversion.sources]
        if conversion.op == "fuse_rows":
            yield conversion.outputs[0][0], torch.cat(weights, dim=0)
            continue
        if conversion.op == "fuse_experts":
            yield conversion.outputs[0][0], torch.cat(weights, dim=1)
            continue
        weight = weights[0]
        if conversion.op == "split_qkv":
            for (name, _), part in zip(conversion.outputs, weight.chunk(3, dim=0)):
                yield name, part.contiguous()
            continue
        if arch.permute_qk and kind == MODEL_TENSOR.ATTN_Q:
            weight = reverse_qk_permute(weight, num_heads)
        elif arch.permute_qk and kind == MODEL_TENSOR.ATTN_K:
            weight = reverse_qk_permute(weight, num_kv_heads)
        elif arch.regroup_neox_qkv and kind == MODEL_TENSOR.ATTN_QKV:
            weight = reverse_neox_qkv(weight, num_heads)
        elif arch.regroup_falcon_qkv and kind == MODEL_TENSOR.ATTN_QKV:
            weight = reverse_falcon_qkv(weight, num_heads, num_kv_heads)
        elif arch.norm_offset and conversion.role.suffix == "weight" and kind in _NORM_KINDS:
            # as transformers does: subtract in float32 (the stored values are 1 + w)
            weight = weight.float() - 1
        elif kind in arch.transposed and weight.dim() == 2:
            weight = weight.t().contiguous()
        name, shape = conversion.outputs[0]
        yield name, weight.reshape(shape)
    if keep_quantized is not None:
        release_pages(gguf_file)


def release_pages(gguf_file: GGUFFile) -> None:
    """Drop the file's pages from this process's resident set once every tensor is copied out.

    The parsed file stays cached (metadata) with its mapping, so the pages read during a load
    would stay counted in the process's memory; they stay in the OS page cache either way.
    """
    mapping = gguf_file.blob.base
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_DONTNEED)


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
