"""cpu_paged against a dense float64 per-sequence reference built from explicit K/V (not from the cache)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagoda.attention.interface import AttentionSpec
from pagoda.plugins import get_plugin_manager
from pagoda.testing.attention import (
    CHUNKED,
    CONFORMANCE_CASES,
    DECODE,
    PREFILL,
    TOLERANCE,
    Batch,
    ConformanceCase,
    Shape,
    UnsupportedCaseError,
    check_cache,
    make_batch,
    params_for,
    reference_attention,
    run_case,
    spec_for,
)
from pagoda.testing.attention import MIXED as TORCH_MIXED
from pagoda.testing.attention import run_and_check as check_backend
from pagoda_attn_cpu.backend import SDPA_PREFILL_MIN_TOKENS, TILE_TOKENS, CpuPagedAttentionBackend

# torch_paged's mix (decodes, chunks on cached prefixes, fresh prefills) plus one longer than two tiles.
MIXED = [*TORCH_MIXED, (0, TILE_TOKENS * 2 + 5)]


def make_backend(shape: Shape, dtype: torch.dtype = torch.float32) -> CpuPagedAttentionBackend:
    return CpuPagedAttentionBackend(spec_for(shape, dtype))


def run_and_check(
    batch: Batch,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    return check_backend(make_backend(shape, dtype), batch, shape, dtype, sliding_window, logits_soft_cap)


@pytest.mark.parametrize("case", [c for c in CONFORMANCE_CASES if not c.alibi], ids=str)
def test_conformance(case: ConformanceCase) -> None:
    run_case(case, CpuPagedAttentionBackend)


@pytest.mark.parametrize("case", [c for c in CONFORMANCE_CASES if c.alibi], ids=str)
def test_alibi_is_refused_so_the_selector_picks_another_backend(case: ConformanceCase) -> None:
    with pytest.raises(UnsupportedCaseError, match="ALiBi"):
        run_case(case, CpuPagedAttentionBackend)


def test_registered_as_a_cpu_attention_backend() -> None:
    spec = get_plugin_manager().attention_backends()["cpu_paged"]
    assert spec.device_types == ("cpu",)
    assert spec.load() is CpuPagedAttentionBackend


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("lens", [DECODE, PREFILL, CHUNKED, MIXED], ids=["decode", "prefill", "chunked", "mixed"])
def test_batches(lens: list[tuple[int, int]], block_size: int) -> None:
    shape = Shape(block_size=block_size)
    run_and_check(make_batch(lens, shape, seed=1), shape)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 2, 16), (4, 4, 16), (4, 1, 8), (2, 1, 40)],
    ids=["9-3", "4-2", "mha", "mqa", "odd-head-dim"],
)
def test_grouped_query_heads(heads: int, kv_heads: int, head_dim: int) -> None:
    shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    run_and_check(make_batch(MIXED, shape, seed=5), shape)
    run_and_check(make_batch(DECODE, shape, seed=6), shape)


@pytest.mark.parametrize("window", [1, 8, 21])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_sliding_window(window: int, lens: list[tuple[int, int]]) -> None:
    shape = Shape(block_size=8)
    run_and_check(make_batch(lens, shape, seed=7), shape, sliding_window=window)


@pytest.mark.parametrize("window", [None, 10])
def test_logits_soft_cap(window: int | None) -> None:
    shape = Shape(num_heads=6, num_kv_heads=2)
    batch = make_batch(MIXED, shape, seed=8)
    # Scale queries up so the cap actually bends the logits.
    batch.query.mul_(4)
    for seq in batch.sequences:
        seq.query.mul_(4)
    run_and_check(batch, shape, sliding_window=window, logits_soft_cap=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_half_precision(dtype: torch.dtype, soft_cap: float | None) -> None:
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)
    run_and_check(make_batch(MIXED + CHUNKED[:2], shape, dtype=dtype, seed=10), shape, dtype, logits_soft_cap=soft_cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(8, 1, 64, 16), (7, 1, 64, 32), (6, 3, 128, 16), (10, 2, 40, 16), (3, 1, 80, 8), (5, 5, 96, 16)],
    ids=["group-8", "group-7-block-32", "dim-128", "dim-40", "dim-80-block-8", "mha-dim-96"],
)
def test_kernel_paths(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Whole-vector and padded head dims, query-head groups split into runs of up to four, blocks of
    one or several vector widths; bf16 rows are widened in a permuted order and stored back in order."""
    shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    lens = MIXED + [(3, 70)]
    run_and_check(make_batch(lens, shape, dtype=dtype, seed=30), shape, dtype)
    run_and_check(make_batch(DECODE, shape, dtype=dtype, seed=31), shape, dtype, sliding_window=21)
    batch = make_batch(DECODE + [(0, 1)], shape, dtype=dtype, seed=32)
    batch.query.mul_(4)
    for seq in batch.sequences:
        seq.query.mul_(4)
    run_and_check(batch, shape, dtype, logits_soft_cap=3.0)


def test_batch_padding_rows_are_zero_and_not_written() -> None:
    shape = Shape(block_size=8)
    for lens in (MIXED, DECODE):
        batch = make_batch(lens, shape, seed=11, padding_rows=3)
        assert (batch.metadata.slot_mapping[-3:] == -1).all()
        run_and_check(batch, shape)


def test_slot_minus_one_inside_a_sequence_is_not_written() -> None:
    shape = Shape(block_size=8)
    batch = make_batch([(10, 1), (0, 20), (3, 4)], shape, seed=12)
    slot = int(batch.metadata.slot_mapping[0])  # the decode of sequence 0
    batch.metadata.slot_mapping[0] = -1
    backend = make_backend(shape)
    backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, backend.prepare(batch.metadata),
                    params_for(shape, 0.25))
    block, offset = divmod(slot, shape.block_size)
    assert torch.equal(batch.kv_cache[:, block, offset], batch.initial_cache[:, block, offset])
    written = batch.metadata.slot_mapping[1:]
    flat = batch.kv_cache[0].reshape(-1, shape.num_kv_heads, shape.head_dim)
    assert torch.equal(flat[written], batch.key[1:])


def test_query_with_strided_tokens() -> None:
    """Queries sliced out of a fused QKV projection are read in place (head_dim contiguous only)."""
    shape = Shape()
    batch = make_batch(MIXED, shape, seed=13)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    batch.query = fused[:, : shape.num_heads]
    assert not batch.query.is_contiguous()
    run_and_check(batch, shape)


def test_layers_share_one_prepare() -> None:
    shape = Shape()
    backend = make_backend(shape)
    layers = [make_batch(MIXED, shape, seed=20 + i, layout_seed=20) for i in range(3)]
    metadata = backend.prepare(layers[0].metadata)
    scale = shape.head_dim**-0.5
    for batch, window in zip(layers, [None, 6, None], strict=True):
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata,
                              params_for(shape, scale, window))
        row = 0
        for seq in batch.sequences:
            expected = reference_attention(seq, scale, window)
            torch.testing.assert_close(out[row : row + seq.query_len].double(), expected, **TOLERANCE[torch.float32])
            row += seq.query_len
        check_cache(batch, shape)


def test_bad_input_is_refused_with_a_clear_error() -> None:
    shape = Shape(block_size=8)
    backend = make_backend(shape)
    batch = make_batch([(10, 1)], shape, seed=14)
    with pytest.raises(RuntimeError, match="not prepared"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, params_for(shape, 0.25))
    metadata = backend.prepare(batch.metadata)
    too_small = batch.kv_cache[:, :1].contiguous()
    with pytest.raises(ValueError, match="past the cache"):
        backend.forward(batch.query, batch.key, batch.value, too_small, metadata, params_for(shape, 0.25))
    batch.metadata.seq_lens_cpu = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        backend.prepare(batch.metadata)


def test_the_kernel_checks_every_block_it_reads_before_writing() -> None:
    """Block ids are checked per layer call (each layer has its own cache), and a refused call writes nothing."""
    shape = Shape(block_size=8)
    backend = make_backend(shape)
    batch = make_batch([(10, 1), (20, 1)], shape, seed=16)
    metadata = backend.prepare(batch.metadata)
    tables = metadata.step.block_tables  # what the kernel reads
    last_column = len(batch.sequences[1].blocks) - 1
    tables[1, last_column] = batch.kv_cache.shape[1]
    with pytest.raises(ValueError, match="past the cache"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, params_for(shape, 0.25))
    tables[1, last_column] = -1
    with pytest.raises(ValueError, match="negative block id"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, params_for(shape, 0.25))
    assert torch.equal(batch.kv_cache, batch.initial_cache)


def test_refuses_other_devices() -> None:
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device_type="cuda", block_size=16
    )
    assert any("'cpu'" in reason for reason in CpuPagedAttentionBackend.reasons_unsupported(spec))
    with pytest.raises(ValueError, match="cpu_paged attention cannot serve"):
        CpuPagedAttentionBackend(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 50])
def test_long_fresh_prefill_beside_decodes(dtype: torch.dtype, window: int | None) -> None:
    """Without a window the long fresh prefill goes to torch's causal SDPA, with one to the kernel."""
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)
    lens = [(40, 1), (0, SDPA_PREFILL_MIN_TOKENS + 3), (70, 1), (30, SDPA_PREFILL_MIN_TOKENS)]
    batch = make_batch(lens, shape, dtype=dtype, seed=15, padding_rows=2)
    step = make_backend(shape, dtype).prepare(batch.metadata).step
    assert [s.row_start for s in step.sdpa_prefills] == [1]  # the cached-prefix chunk stays with the kernel
    run_and_check(batch, shape, dtype, sliding_window=window)


def test_a_failed_build_is_a_reason_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the C++ kernel cannot be compiled, the selector sees why and moves on to the next backend."""
    from pagoda.cpp_extension import CppExtension
    from pagoda_attn_cpu import kernel as kernel_module

    broken = CppExtension("pagoda_test_broken_attn", "pagoda_attn_cpu", ["csrc/no_such_kernel.cpp"])
    monkeypatch.setattr(kernel_module, "extension", lambda dtype, head_dim, cache_dtype=None: broken)
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device_type="cpu", block_size=16
    )
    (reason,) = CpuPagedAttentionBackend.reasons_unsupported(spec)
    assert "could not be compiled" in reason and "no_such_kernel.cpp" in reason
    with pytest.raises(ValueError, match="could not be compiled"):
        CpuPagedAttentionBackend(spec)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The kernel plans its work for torch's thread count: two threads split a lone long decode."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (2, 1, 40)], ids=["9-3", "mqa-dim-128", "dim-40"]
)
def test_few_long_decodes_split_their_keys(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Decodes too few to busy the threads split their keys into parts whose partial results are
    merged; a window or a soft cap applies within each part, short decodes stay whole, and a
    batch too small to be worth a second thread runs on the calling one."""
    shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    for lens in ([(300, 1)], [(130, 1), (200, 1), (5, 1)], [(64, 1), (0, 40)], [(20, 1)]):
        run_and_check(make_batch(lens, shape, dtype=dtype, seed=40), shape, dtype)
        run_and_check(make_batch(lens, shape, dtype=dtype, seed=41), shape, dtype, sliding_window=150)
        batch = make_batch(lens, shape, dtype=dtype, seed=42)
        batch.query.mul_(4)
        for seq in batch.sequences:
            seq.query.mul_(4)
        run_and_check(batch, shape, dtype, logits_soft_cap=3.0)


# Prefill tiles (more than one query token) go through the rows-in-lanes path: query rows a vector,
# row counts that do not fill the last vector, blocks the causal mask or a window cuts anywhere.
TILE_LENS = [(0, 2), (0, 5), (0, 17), (3, 14), (40, 33), (0, TILE_TOKENS + 7), (17, TILE_TOKENS * 2 + 3)]


def _tile_checks(backend: CpuPagedAttentionBackend, shape: Shape, dtype: torch.dtype, seed: int) -> None:
    check_backend(backend, make_batch(TILE_LENS, shape, dtype=dtype, seed=seed), shape, dtype, None, None)
    for window in (1, 6, 37):
        check_backend(backend, make_batch(TILE_LENS, shape, dtype=dtype, seed=seed + 1), shape, dtype, window, None)
    batch = make_batch(TILE_LENS, shape, dtype=dtype, seed=seed + 2)
    batch.query.mul_(4)
    for seq in batch.sequences:
        seq.query.mul_(4)
    check_backend(backend, batch, shape, dtype, 9, 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 64, 8), (8, 1, 128, 32), (4, 2, 256, 16)],
    ids=["group-3", "mha-block-8", "group-8-dim-128", "dim-256"],
)
def test_prefill_tiles(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    _tile_checks(make_backend(shape, dtype), shape, dtype, seed=50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_avx2_build(dtype: torch.dtype) -> None:
    """The 8-lane build (-march=haswell: one row vector at a time) through the same tile checks."""
    import shutil

    from pagoda.cpp_extension import CppExtension
    from pagoda_attn_cpu import kernel as kernel_module

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    code = {torch.float32: 0, torch.bfloat16: 1}[dtype]
    ext = CppExtension(f"pagoda_attn_cpu_test_avx2_{code}_d64", "pagoda_attn_cpu", ["csrc/paged_attention.cpp"],
                       cflags=("-O2", "-march=haswell", "-fopenmp", "-ffp-contract=fast", f"-DPAGODA_ATTN_DTYPE={code}",
                               "-DPAGODA_ATTN_HEAD_DIM=64"))
    avx2 = kernel_module.PagedAttentionKernel(ext.library(), dtype)
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)

    class Avx2Backend(CpuPagedAttentionBackend):
        def __init__(self, spec: object) -> None:
            super().__init__(spec)  # type: ignore[arg-type]
            self._kernel = avx2

    _tile_checks(Avx2Backend(spec_for(shape, dtype)), shape, dtype, seed=60)
