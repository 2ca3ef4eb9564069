"""torch_paged against a dense per-sequence reference built from explicit K/V (not from the cache)."""

from __future__ import annotations

import pytest
import torch
from torch_paged_cases import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    TOLERANCE,
    Batch,
    Shape,
    check_cache,
    make_batch,
    reference_attention,
    spec_for,
)
from torch_paged_cases import run_and_check as check_backend

from pagoda.attention.interface import AttentionMetadata, AttentionSpec
from pagoda_attn_torch.backend import TorchPagedAttentionBackend


def make_backend(shape: Shape, dtype: torch.dtype = torch.float32, **spec_fields) -> TorchPagedAttentionBackend:
    return TorchPagedAttentionBackend(spec_for(shape, dtype, **spec_fields))


def run_and_check(
    batch: Batch,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    check_backend(make_backend(shape, dtype), batch, shape, dtype, sliding_window, logits_soft_cap)


@pytest.mark.parametrize("block_size", [16, 8])
def test_pure_prefill(block_size: int) -> None:
    shape = Shape(block_size=block_size)
    run_and_check(make_batch(PREFILL, shape, seed=1), shape)


@pytest.mark.parametrize("block_size", [16, 8])
def test_chunked_prefill_on_cached_prefix(block_size: int) -> None:
    shape = Shape(block_size=block_size)
    run_and_check(make_batch(CHUNKED, shape, seed=2), shape)


@pytest.mark.parametrize("block_size", [16, 8])
def test_pure_decode(block_size: int) -> None:
    shape = Shape(block_size=block_size)
    batch = make_batch(DECODE, shape, seed=3)
    assert batch.metadata.is_all_decode
    run_and_check(batch, shape)


@pytest.mark.parametrize("block_size", [16, 8])
def test_mixed_batch(block_size: int) -> None:
    shape = Shape(block_size=block_size)
    run_and_check(make_batch(MIXED, shape, seed=4), shape)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 16), (4, 1, 8)], ids=["4-2", "9-3", "mha", "mqa"]
)
def test_grouped_query_heads(heads: int, kv_heads: int, head_dim: int) -> None:
    shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    run_and_check(make_batch(MIXED, shape, seed=5), shape)
    run_and_check(make_batch(DECODE, shape, seed=6), shape)


@pytest.mark.parametrize("window", [1, 8, 21])
@pytest.mark.parametrize("lens", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_sliding_window(window: int, lens: list[tuple[int, int]]) -> None:
    shape = Shape(block_size=8)
    run_and_check(make_batch(lens, shape, seed=7), shape, sliding_window=window)


@pytest.mark.parametrize("lens", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_logits_soft_cap(lens: list[tuple[int, int]]) -> None:
    shape = Shape(num_heads=6, num_kv_heads=2)
    batch = make_batch(lens, shape, seed=8)
    # Scale queries up so the cap actually bends the logits.
    batch.query.mul_(4)
    for seq in batch.sequences:
        seq.query.mul_(4)
    run_and_check(batch, shape, logits_soft_cap=2.0)


def test_soft_cap_with_sliding_window() -> None:
    shape = Shape()
    run_and_check(make_batch(MIXED, shape, seed=9), shape, sliding_window=10, logits_soft_cap=3.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_half_precision(dtype: torch.dtype, soft_cap: float | None) -> None:
    shape = Shape(num_heads=9, num_kv_heads=3, head_dim=64)
    run_and_check(make_batch(MIXED + CHUNKED[:2], shape, dtype=dtype, seed=10), shape, dtype, logits_soft_cap=soft_cap)


def test_batch_padding_rows_are_not_written() -> None:
    shape = Shape(block_size=8)
    for lens in (MIXED, DECODE):
        batch = make_batch(lens, shape, seed=11, padding_rows=3)
        assert (batch.metadata.slot_mapping[-3:] == -1).all()
        run_and_check(batch, shape)


def test_slot_minus_one_inside_a_sequence_is_not_written() -> None:
    shape = Shape(block_size=8)
    batch = make_batch([(10, 1), (0, 20), (3, 4)], shape, seed=12)
    skipped = 0  # the decode of sequence 0
    slot = int(batch.metadata.slot_mapping[skipped])
    batch.metadata.slot_mapping[skipped] = -1
    backend = make_backend(shape)
    backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, backend.prepare(batch.metadata), 0.25)
    block, offset = divmod(slot, shape.block_size)
    assert torch.equal(batch.kv_cache[:, block, offset], batch.initial_cache[:, block, offset])
    # The other sequences' new tokens were written.
    written = batch.metadata.slot_mapping[1:]
    flat = batch.kv_cache[0].reshape(-1, shape.num_kv_heads, shape.head_dim)
    assert torch.equal(flat[written], batch.key[1:])


def test_layers_share_one_plan() -> None:
    """One prepare per step serves every layer, each with its own cache, window and inputs."""
    shape = Shape()
    backend = make_backend(shape)
    lens = MIXED + [(0, 30)]
    layers = [make_batch(lens, shape, seed=20 + i, layout_seed=20) for i in range(3)]
    metadata = backend.prepare(layers[0].metadata)
    windows = [None, 6, None]
    scale = shape.head_dim**-0.5
    for batch, window in zip(layers, windows, strict=True):
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, scale, window)
        row = 0
        for seq in batch.sequences:
            expected = reference_attention(seq, scale, window)
            torch.testing.assert_close(out[row : row + seq.query_len].double(), expected, **TOLERANCE[torch.float32])
            row += seq.query_len
        check_cache(batch, shape)


def test_decodes_of_very_different_lengths_split_into_buckets() -> None:
    shape = Shape(block_size=8)
    lens = [(c, 1) for c in (300, 5, 150, 7, 290, 60, 2, 140)]
    batch = make_batch(lens, shape, seed=30)
    plan = make_backend(shape).prepare(batch.metadata).extra["torch_paged"]
    assert len(plan.batched) > 1
    longest_first = [g.padded_kv_len for g in plan.batched]
    assert longest_first == sorted(longest_first, reverse=True) and longest_first[-1] <= 64
    run_and_check(batch, shape)


def test_uniform_decode_batch_is_one_in_order_group() -> None:
    shape = Shape()
    batch = make_batch([(c, 1) for c in (200, 230, 255, 180)], shape, seed=31)
    plan = make_backend(shape).prepare(batch.metadata).extra["torch_paged"]
    (group,) = plan.batched
    assert group.query_rows is None and group.result_index is None and not plan.looped
    run_and_check(batch, shape)


def test_batch_of_only_padding_rows() -> None:
    shape = Shape()
    backend = make_backend(shape)
    cache = torch.randn(2, 4, shape.block_size, shape.num_kv_heads, shape.head_dim)
    before = cache.clone()
    metadata = AttentionMetadata(
        num_seqs=0,
        num_tokens=2,
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        slot_mapping=torch.full((2,), -1, dtype=torch.int64),
        max_query_len=0,
        max_seq_len=0,
    )
    q = torch.randn(2, shape.num_heads, shape.head_dim)
    k = torch.randn(2, shape.num_kv_heads, shape.head_dim)
    out = backend.forward(q, k, k.clone(), cache, backend.prepare(metadata), 0.25)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(cache, before)


def test_forward_without_prepare_is_refused() -> None:
    shape = Shape()
    batch = make_batch(DECODE, shape)
    with pytest.raises(RuntimeError, match="prepare"):
        make_backend(shape).forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, 0.25)


def test_cache_of_wrong_shape_is_refused() -> None:
    shape = Shape()
    batch = make_batch(DECODE, shape)
    backend = make_backend(shape)
    metadata = backend.prepare(batch.metadata)
    wrong = batch.kv_cache.transpose(3, 4).contiguous()
    with pytest.raises(ValueError, match="kv_cache shape"):
        backend.forward(batch.query, batch.key, batch.value, wrong, metadata, 0.25)


def test_reasons_unsupported() -> None:
    good = AttentionSpec(
        num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, device_type="cpu", block_size=16
    )
    assert TorchPagedAttentionBackend.reasons_unsupported(good) == []
    for dtype in (torch.bfloat16, torch.float16):
        spec = AttentionSpec(9, 3, 64, dtype, "cpu", 16)
        assert TorchPagedAttentionBackend.reasons_unsupported(spec) == []

    cases = {
        "dtype": AttentionSpec(9, 3, 64, torch.float64, "cpu", 16),
        "device type": AttentionSpec(9, 3, 64, torch.float32, "mps", 16),
        "multiple of num_kv_heads": AttentionSpec(8, 3, 64, torch.float32, "cpu", 16),
        "block_size": AttentionSpec(9, 3, 64, torch.float32, "cpu", 0),
        "sliding_window": AttentionSpec(9, 3, 64, torch.float32, "cpu", 16, sliding_window=0),
        "logits_soft_cap": AttentionSpec(9, 3, 64, torch.float32, "cpu", 16, logits_soft_cap=-1.0),
    }
    for needle, spec in cases.items():
        reasons = TorchPagedAttentionBackend.reasons_unsupported(spec)
        assert len(reasons) == 1 and needle in reasons[0], (needle, reasons)
    with pytest.raises(ValueError, match="dtype"):
        TorchPagedAttentionBackend(cases["dtype"])


def test_registered_as_plugin() -> None:
    from pagoda_attn_torch.plugin import pagoda_register_attention_backends

    (spec,) = pagoda_register_attention_backends()
    assert spec.name == "torch_paged"
    assert spec.load() is TorchPagedAttentionBackend
