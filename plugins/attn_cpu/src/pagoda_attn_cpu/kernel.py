"""The C++ kernel (``csrc/paged_attention.cpp``), built once per machine through ``pagoda.cpp_extension``.

One library per (dtype, cache dtype, head_dim), the cache dtype being the model's or fp8
(float8_e4m3fn / float8_e5m2, quantized on write and converted in registers on read): the kernel's fast paths are templates over the head's
vector count, and one dtype at one head_dim compiles in 3-5 s where all of them took ~15 s of
CPU (see the source). The Python side checks shapes and dtypes and allocates the output; the
library checks the metadata (every block id it reads, every slot it writes) and refuses a
batch that does not fit before writing anything.
"""

from __future__ import annotations

import threading
from types import ModuleType

import torch

from pagoda.cpp_extension import CppExtension
from pagoda.cpp_extension.build import DEFAULT_CFLAGS

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The model dtypes the kernel is built for.
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)
_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_FP8_CODES = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
# Head dims with a register-resident path: 4, 8 or 16 whole vectors a head (64, 128, 256 with
# AVX-512's 16 floats a vector; 32, 64, 128 with 8). Each gets its own library; the others share
# one with the generic path only.
_FAST_HEAD_DIMS = (32, 64, 128, 256)
_ERROR_BYTES = 512

_lock = threading.Lock()
_extensions: dict[tuple[torch.dtype, torch.dtype, int], CppExtension] = {}


def _cache_code(dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    if cache_dtype == dtype:
        return _DTYPE_CODES[dtype]
    if cache_dtype in _FP8_CODES:
        return _FP8_CODES[cache_dtype]
    raise ValueError(f"cpu_paged attention has no kernel for a {cache_dtype} cache under a {dtype} model "
                     "(the cache holds the model dtype, float8_e4m3fn or float8_e5m2)")


def extension(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> CppExtension:
    """The library for this model dtype, head_dim and cache dtype (None: the model's); not built yet:
    ``start()`` or ``library()`` builds it."""
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"cpu_paged attention has no kernel for {dtype} (float32, bfloat16, float16)")
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    cache_code = _cache_code(dtype, cache_dtype)
    fast = head_dim if head_dim in _FAST_HEAD_DIMS else 0
    with _lock:
        ext = _extensions.get((dtype, cache_dtype, fast))
        if ext is None:
            suffix = f"_kv{_FP8_NAMES[cache_dtype]}" if cache_dtype in _FP8_NAMES else ""
            name = f"pagoda_attn_cpu_{_DTYPE_NAMES[dtype]}{suffix}_d{fast}"
            flags = (f"-DPAGODA_ATTN_DTYPE={_DTYPE_CODES[dtype]}", f"-DPAGODA_ATTN_CACHE={cache_code}",
                     f"-DPAGODA_ATTN_HEAD_DIM={fast}")
            ext = CppExtension(name, "pagoda_attn_cpu", ["csrc/paged_attention.cpp"], cflags=(*DEFAULT_CFLAGS, *flags))
            _extensions[(dtype, cache_dtype, fast)] = ext
        return ext


def build_failure(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> str | None:
    """Why the kernel for this dtype, head_dim and cache dtype is unusable here, or None once it is built
    (building it if needed)."""
    try:
        return extension(dtype, head_dim, cache_dtype).build_failure()
    except ValueError as exc:
        return str(exc)


# The step's metadata as the library reads it: (slot_mapping, slots, query_start, seq_lens, seqs,
# block_tables, rows, columns, seq_ids, ids) as pointers and counts. The tensors must stay alive
# while it is used (the backend's step object holds both).
StepMetadata = tuple[int, int, int, int, int, int, int, int, int, int]


def step_metadata(
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
) -> StepMetadata:
    """Check the step's host-side metadata tensors once (every layer's call reuses the result)."""
    if (
        slot_mapping.dtype != torch.int64
        or query_start.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or block_tables.dtype != torch.int32
        or seq_ids.dtype != torch.int32
    ):
        raise RuntimeError("slot_mapping must be int64; query_start, seq_lens, block_tables, seq_ids int32")
    tensors = (slot_mapping, query_start, seq_lens, block_tables, seq_ids)
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        raise RuntimeError("metadata tensors must be contiguous CPU tensors")
    if query_start.dim() != 1 or seq_lens.dim() != 1 or query_start.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("attention metadata: query_start_loc needs one entry more than seq_lens")
    if block_tables.dim() != 2:
        raise ValueError("attention metadata: block_tables needs a row per sequence")
    rows, columns = block_tables.shape
    return (
        slot_mapping.data_ptr(), slot_mapping.numel(), query_start.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0],
        block_tables.data_ptr(), rows, columns, seq_ids.data_ptr(), seq_ids.numel(),
    )  # fmt: skip


class PagedAttentionKernel:
    """``pagoda_paged_attention`` of one library: argument checks in Python, the work (GIL released) in C++."""

    def __init__(self, library: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> None:
        self._fn = library.pagoda_paged_attention
        self._code = _DTYPE_CODES[dtype]
        self.dtype = dtype
        self.cache_dtype = dtype if cache_dtype is None else cache_dtype
        self._cache_code = _cache_code(dtype, self.cache_dtype)
        self._errors = threading.local()

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        seq_ids: torch.Tensor,
        scale: float,
        window: int,
        soft_cap: float,
        tile_tokens: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Writes the new K/V (slot -1: skipped), then attends the sequences in ``seq_ids``.

        query [tokens, heads, head_dim] (head_dim contiguous); key/value [tokens, kv_heads, head_dim];
        kv_cache [2, blocks, block_size, kv_heads, head_dim] contiguous; int32 host-side metadata
        (slot_mapping int64). Returns [tokens, heads, head_dim]; rows past the last sequence are zero.
        An fp8 cache stores saturate(k / k_scale), saturate(v / v_scale) and reads them back scaled.
        """
        metadata = step_metadata(slot_mapping, query_start, seq_lens, block_tables, seq_ids)
        return self.attend(query, key, value, kv_cache, metadata, scale, window, soft_cap, tile_tokens, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: StepMetadata,
        scale: float,
        window: int,
        soft_cap: float,
        tile_tokens: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """As ``__call__``, with the metadata from ``step_metadata`` (its tensors alive)."""
        dtype = self.dtype
        if query.dtype is not dtype or key.dtype is not dtype or value.dtype is not dtype:
            raise RuntimeError(f"query, key and value must share one dtype ({dtype} for this kernel)")
        if kv_cache.dtype is not self.cache_dtype:
            raise RuntimeError(f"kv_cache must be {self.cache_dtype} for this kernel, got {kv_cache.dtype}")
        if not (query.is_cpu and key.is_cpu and value.is_cpu and kv_cache.is_cpu):
            raise RuntimeError("cpu_paged attention runs on CPU tensors")
        q_strides, k_strides, v_strides = query.stride(), key.stride(), value.stride()
        if len(q_strides) != 3 or q_strides[2] != 1:
            raise RuntimeError("query must be [tokens, heads, head_dim] with contiguous head_dim")
        cache_shape = kv_cache.shape
        if len(cache_shape) != 5 or cache_shape[0] != 2 or not kv_cache.is_contiguous():
            raise RuntimeError("kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor")
        tokens, heads, head_dim = query.shape
        _, blocks, block_size, kv_heads, cache_head_dim = cache_shape
        if cache_head_dim != head_dim or heads % kv_heads != 0:
            raise RuntimeError("query and kv_cache heads do not fit")
        key_shape, value_shape = key.shape, value.shape
        if (
            len(key_shape) != 3
            or len(value_shape) != 3
            or key_shape[0] < tokens
            or value_shape[0] < tokens
            or key_shape[1] != kv_heads
            or value_shape[1] != kv_heads
            or key_shape[2] != head_dim
            or value_shape[2] != head_dim
        ):
            raise RuntimeError("key and value must be [tokens, kv_heads, head_dim]")
        if k_strides[2] != 1:
            key = key.contiguous()
            k_strides = key.stride()
        if v_strides[2] != 1:
            value = value.contiguous()
            v_strides = value.stride()
        out = torch.empty(tokens, heads, head_dim, dtype=dtype)
        error = self._error_buffer()
        status = self._fn(
            self._code, self._cache_code, k_scale, v_scale,
            query.data_ptr(), tokens, heads, head_dim, q_strides[0], q_strides[1],
            key.data_ptr(), k_strides[0], k_strides[1],
            value.data_ptr(), v_strides[0], v_strides[1],
            kv_cache.data_ptr(), blocks, block_size, kv_heads,
            *metadata,
            scale, window, soft_cap, tile_tokens,
            out.data_ptr(), torch.get_num_threads(),
            error.data_ptr(), _ERROR_BYTES,
        )  # fmt: skip
        if status != 0:
            raise ValueError(bytes(error.numpy()).split(b"\0", 1)[0].decode(errors="replace"))
        return out

    def _error_buffer(self) -> torch.Tensor:
        # Where the library writes why it refused a call; one per thread: steps may run on several at once.
        buffer = getattr(self._errors, "buffer", None)
        if buffer is None:
            buffer = self._errors.buffer = torch.zeros(_ERROR_BYTES, dtype=torch.uint8)
        return buffer


_kernels: dict[tuple[torch.dtype, int, torch.dtype | None], PagedAttentionKernel] = {}


def kernel(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> PagedAttentionKernel:
    """The kernel for this model dtype, head_dim and cache dtype (None: the model's); builds it (or waits
    for its build) on first use.

    Raises ExtensionBuildError when it cannot be built."""
    key = (dtype, head_dim, cache_dtype)
    found = _kernels.get(key)
    if found is None:
        found = _kernels[key] = PagedAttentionKernel(extension(dtype, head_dim, cache_dtype).library(), dtype, cache_dtype)
    return found


def start_build(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> None:
    """Begin building the kernel for this dtype, head_dim and cache dtype in the background (nothing for an
    uncovered dtype)."""
    if dtype in _DTYPE_CODES and (cache_dtype is None or cache_dtype == dtype or cache_dtype in _FP8_CODES):
        extension(dtype, head_dim, cache_dtype).start()
