"""The lazily mapped KV cache and its prefault (pagoda.worker.host_memory)."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from pagoda.worker import host_memory
from pagoda.worker.host_memory import PAGE, populate, resident_pages, zeros_lazy

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux")


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
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_populate_on_several_threads_covers_every_tensor(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setattr(host_memory, "PREFAULT_CHUNK", 1 << 20)  # many chunks for the threads to share
    caches = [zeros_lazy((2, 64, 16, 3, 64), torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    assert populate(caches, threads=threads) == sum(c.numel() * 2 for c in caches)
    for c in caches:
        resident, total = resident_pages(c)
        assert resident == total
        assert c.abs().sum().item() == 0.0


def test_populate_without_madvise_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_madvise", lambda: None)
    assert populate([torch.zeros(10)], threads=2) == 0


@linux_only
def test_a_refused_advice_leaves_the_memory_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    t = zeros_lazy((mmap.PAGESIZE * 4,), torch.uint8, torch.device("cpu"))
    assert populate([t]) == 0
    assert populate([t], threads=3) == 0
