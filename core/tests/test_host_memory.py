"""The lazily mapped KV cache and its background prefault (pagoda.worker.host_memory)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import threading

import pytest
import torch

from pagoda.worker import host_memory
from pagoda.worker.host_memory import PAGE, populate, prefault_in_background, zeros_lazy

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux")


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of a tensor's memory, from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    begin = t.data_ptr() // PAGE * PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - begin) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(begin, end - begin, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def populate_supported() -> bool:
    probe = zeros_lazy((PAGE,), torch.uint8, torch.device("cpu"))
    return populate([probe]) == PAGE


@linux_only
def test_zeros_lazy_maps_nothing_until_touched_and_reads_zero() -> None:
    t = zeros_lazy((4 << 20,), torch.float32, torch.device("cpu"))  # 16 MiB
    resident, total = resident_pages(t)
    assert resident < total // 4  # nothing wrote it: (almost) nothing mapped
    assert t[:: 4096].abs().sum().item() == 0.0


@linux_only
def test_populate_maps_every_page_and_keeps_the_contents() -> None:
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    t = zeros_lazy((3, 1 << 20), torch.float32, torch.device("cpu"))  # 12 MiB
    t[1, 7] = 5.0
    done = populate([t])
    assert done >= t.numel() * 4
    resident, total = resident_pages(t)
    assert resident == total
    assert t[1, 7].item() == 5.0 and t.sum().item() == 5.0


@linux_only
def test_populate_stops_when_asked_and_skips_freed_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setattr(host_memory, "PREFAULT_CHUNK", 1 << 20)
    stop = threading.Event()
    stop.set()
    t = zeros_lazy((1 << 20,), torch.float32, torch.device("cpu"))
    assert populate([t], stop) == 0
    import weakref

    gone = zeros_lazy((1 << 20,), torch.float32, torch.device("cpu"))
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
    assert populate([ref, t]) == 4 << 20  # only the live one


@linux_only
def test_prefault_in_background_populates_an_idle_cache() -> None:
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    caches = [zeros_lazy((2, 64, 16, 64), torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    job = prefault_in_background(caches)
    assert job is not None
    job.thread.join(timeout=60)
    assert not job.thread.is_alive()
    assert job.populated == job.total == sum(c.numel() * 2 for c in caches)
    for c in caches:
        resident, total = resident_pages(c)
        assert resident == total


def test_prefault_in_background_has_nothing_to_do_without_cpu_tensors() -> None:
    assert prefault_in_background([]) is None


def test_populate_without_madvise_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_madvise", lambda: None)
    assert populate([torch.zeros(10)]) == 0
    assert prefault_in_background([torch.zeros(10)]) is None


@linux_only
def test_a_refused_advice_stops_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    t = zeros_lazy((mmap.PAGESIZE * 4,), torch.uint8, torch.device("cpu"))
    assert populate([t]) == 0
