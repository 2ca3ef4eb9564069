"""The huge-page arena the packed weights live in."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from pagoda_platform_cpu import gemm as gemm_module
from pagoda_platform_cpu.huge_pages import HUGE_PAGE, HugePageArena
from pagoda_platform_cpu.platform import GEMM_ENV, GEMV_ENV, PACKED_LINEAR_ENV, CpuPlatform

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


@needs_madvise
def test_tensors_are_zero_page_aligned_disjoint_and_outlive_the_arena() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    a = arena.zeros((3, 5), torch.bfloat16)
    b = arena.zeros((1000,), torch.float32)
    big = arena.zeros((3 * HUGE_PAGE // 4,), torch.float32)  # larger than a chunk: a mapping of its own
    for t in (a, b, big):
        assert t.is_contiguous() and bool((t == 0).all()) and t.data_ptr() % 4096 == 0
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert big.data_ptr() % HUGE_PAGE == 0  # a fresh mapping starts on a huge-page boundary
    a.fill_(1)
    b.fill_(2)
    assert bool((a == 1).all()) and bool((b == 2).all())  # writing one leaves the other alone
    del arena
    gc.collect()
    big.fill_(3)  # the mapping lives as long as a tensor cut from it
    assert float(big.sum()) == 3 * big.numel()


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple"):
        HugePageArena(chunk_bytes=12345)


@needs_madvise
@pytest.mark.skipif(gemm_module.unavailable_reason(torch.float32) is not None, reason="no packed-matmul kernel")
def test_packed_weights_in_huge_pages_multiply_exactly_as_before() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 48, generator=g)
    x = torch.randn(9, 48, generator=g)
    kernel = gemm_module.PackedGemmKernel((torch.float32,))
    prepared = kernel.prepare(w)
    assert prepared.packed.untyped_storage().nbytes() >= HUGE_PAGE  # a view into the arena, not its own allocation
    torch.testing.assert_close(kernel.apply(x, prepared, None), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_madvise
@pytest.mark.skipif(gemm_module.unavailable_reason(torch.float32) is not None, reason="no packed-matmul kernel")
def test_the_platform_hands_its_one_arena_to_every_packed_matmul_it_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (PACKED_LINEAR_ENV, GEMV_ENV, GEMM_ENV):
        monkeypatch.delenv(name, raising=False)
    platform = CpuPlatform()
    first, second = platform.linear_kernel(torch.float32), platform.linear_kernel(torch.float32)
    assert isinstance(first, gemm_module.PackedGemmKernel) and isinstance(second, gemm_module.PackedGemmKernel)
    assert first.arena is second.arena is platform.packed_weight_arena
    assert CpuPlatform().packed_weight_arena is not platform.packed_weight_arena  # owned, not process-wide
    a = first.prepare(torch.ones(32, 16))
    b = second.prepare(torch.ones(32, 16))
    # consecutive weights of one model lie page after page in the same mapping
    assert b.packed.data_ptr() - a.packed.data_ptr() == 4096
    assert a.packed.untyped_storage().data_ptr() == b.packed.untyped_storage().data_ptr()
