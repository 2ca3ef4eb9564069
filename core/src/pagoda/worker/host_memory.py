"""Host memory for the KV cache: mapped lazily, and faulted in at start-up.

The cache is a shared anonymous mapping (``zeros_lazy``; Python's ``mmap`` default). That is shmem:
its huge pages follow ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``, commonly ``never``, so
``MADV_HUGEPAGE`` is only a request. A private mapping gets anonymous huge pages under the usual
``madvise`` mode; measured on the guest below, that made decode attention ~4% faster but the 4 GiB
prefault 5.4-6.5 s against 2.3 s in 4 KiB pages, so the mapping stays shared. Left lazy,
the first write to each page costs a fault, the OS zeroing it and, under a hypervisor, the host
backing it; and the block allocator hands out every block of the pool before it reuses one (LRU
over cached prefixes), so those faults land on requests' latency for as long as the engine takes
to go round the whole pool once (~186K tokens of SmolLM2 in a 4 GiB bf16 cache; the CPU default
follows the model, 31K tokens for SmolLM2-135M Q4_1).
Measured on a 2-vCPU KVM guest (Zen 5): a 512-token prefill step's K/V writes (786 KB a layer,
fp32) took ~0.25 ms a layer on fresh pages against a few µs on touched ones, ~5% of the step.

``populate`` faults a mapping in with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) from several
threads at once (ctypes releases the GIL for each chunk): on that guest 4 GiB took 1.4-2.3 s on 2
threads. Where the kernel lacks the advice, nothing is populated and the cache stays lazy.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it before 3.13
# Bytes a call populates: small enough that the GIL changes hands ~16 times a GiB, big enough that
# the calls themselves cost nothing.
PREFAULT_CHUNK = 64 << 20
PAGE = mmap.PAGESIZE


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are mapped on first touch, in huge pages where shmem's setting allows.

    torch.zeros memsets the whole KV cache up front, page fault by page fault (5.7 s for
    4 GiB on the 2-vCPU guest); an anonymous mapping gets zero pages from the OS lazily, and
    ``populate`` can fault it in on several threads (1.4-2.3 s). Huge pages cut TLB misses on the
    scattered block reads of decode attention (~4% on 2 threads), but the mapping is shared, so it
    gets them only where ``shmem_enabled`` allows (module docstring).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * math.prod(shape)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled or unsupported: plain pages
            buffer.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps the mapping alive as long as the tensor
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _pages(tensor: torch.Tensor) -> tuple[int, int]:
    """[begin, end) addresses of a tensor's memory, begin rounded down to its page."""
    return tensor.data_ptr() // PAGE * PAGE, tensor.data_ptr() + tensor.numel() * tensor.element_size()


def populate(tensors: Sequence[torch.Tensor], threads: int = 1) -> int:
    """Fault in the pages of CPU tensors (MADV_POPULATE_WRITE), PREFAULT_CHUNK bytes a call on
    ``threads`` threads; returns the bytes populated. Contents are unchanged. A chunk the kernel
    refuses (no such advice before Linux 5.14: every call fails at once) is left lazy."""
    madvise = _madvise()
    if madvise is None:
        return 0
    chunks = []
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.numel():
            begin, end = _pages(tensor)
            chunks += [(start, min(PREFAULT_CHUNK, end - start)) for start in range(begin, end, PREFAULT_CHUNK)]

    def one(chunk: tuple[int, int]) -> int:
        return chunk[1] if madvise(chunk[0], chunk[1], MADV_POPULATE_WRITE) == 0 else 0

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="pagoda-kv-prefault") as pool:
        sizes = list(pool.map(one, chunks))
    if 0 in sizes:
        logger.debug("KV cache prefault: madvise(MADV_POPULATE_WRITE) refused %d of %d chunks", sizes.count(0),
                     len(sizes))
    return sum(sizes)


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of a CPU tensor's memory, from mincore(2) (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    begin, end = _pages(tensor)
    pages = -(-(end - begin) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(begin, end - begin, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec), pages
