"""Zeroed CPU tensors in transparent-huge-page memory, for weights that are streamed every step.

A packed weight is read from memory once per product at few rows, 4 KiB page by 4 KiB page: each
page costs a TLB miss and restarts the hardware prefetcher. Backed by 2 MiB pages, SmolLM2-135M's 30
cold decoder layers (212 MB bf16) ran 2x faster at 1 row, 1.3x at 8, 1.14x at 32 and ~1.05x at 64-128
rows in thread CPU time on the 2-vCPU Zen 4 (same process, interleaved; docs/benchmarks.md). Most
systems set THP to ``madvise``, and torch's allocator asks for it only with ``THP_MEM_ALLOC_ENABLE=1``
read at start-up, so the memory is mapped here and ``madvise(MADV_HUGEPAGE)`` asked for it.

Tensors are carved from 64 MiB anonymous mappings (already zero); each tensor keeps its mapping
alive through ``torch.frombuffer``, so a mapping is unmapped once the last tensor cut from it (and
the arena, which holds only the newest one) lets go. Where ``MADV_HUGEPAGE`` does not exist (not
Linux) the tensors are plain ``torch.zeros``. The CPU platform owns the process's arena
(``CpuPlatform.packed_weight_arena``) and hands it to the packed matmul it chooses, so every packed
weight of a model is cut from the same mappings.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
ALIGN = 4096  # each tensor starts on its own page: no two weights share a line or a page's prefetch


class HugePageArena:
    """Bump allocator over huge-page-advised anonymous mappings."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        if chunk_bytes <= 0 or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {HUGE_PAGE}, got {chunk_bytes}")
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None  # uint8 view of the newest mapping, from its 2 MiB boundary
        self._used = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed, contiguous tensor; from huge-page memory where the OS has ``MADV_HUGEPAGE``."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if self._chunk is None or self._used + size > self._chunk.numel():
                self._chunk = self._map(max(self._chunk_bytes, -(-size // HUGE_PAGE) * HUGE_PAGE))
                self._used = 0
            piece = self._chunk[self._used:self._used + nbytes]
            self._used += size
        return piece.view(dtype).view(shape)

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        # One huge page extra so the usable part can start on a 2 MiB boundary (mmap only promises 4 KiB).
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        return whole[start:start + nbytes]
