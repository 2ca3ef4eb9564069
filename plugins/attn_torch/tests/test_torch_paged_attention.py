"""torch_paged: the shared conformance cases (pagoda.testing.attention), then what is torch_paged's own."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention.interface import AttentionSpec
from pagoda.testing.attention import (
    CONFORMANCE_CASES,
    DECODE,
    ConformanceCase,
    Shape,
    make_batch,
    params_for,
    run_case,
    spec_for,
)
from pagoda.testing.attention import run_and_check as check_backend
from pagoda_attn_torch.backend import TorchPagedAttentionBackend


def make_backend(shape: Shape, dtype: torch.dtype = torch.float32) -> TorchPagedAttentionBackend:
    return TorchPagedAttentionBackend(spec_for(shape, dtype))


@pytest.mark.parametrize("case", CONFORMANCE_CASES, ids=str)
def test_conformance(case: ConformanceCase) -> None:
    run_case(case, TorchPagedAttentionBackend)


def test_decodes_of_very_different_lengths_split_into_buckets() -> None:
    shape = Shape(block_size=8)
    lens = [(c, 1) for c in (300, 5, 150, 7, 290, 60, 2, 140)]
    batch = make_batch(lens, shape, seed=30)
    plan = make_backend(shape).prepare(batch.metadata).plan
    assert len(plan.batched) > 1
    longest_first = [g.padded_kv_len for g in plan.batched]
    assert longest_first == sorted(longest_first, reverse=True) and longest_first[-1] <= 64
    check_backend(make_backend(shape), batch, shape)


def test_uniform_decode_batch_is_one_in_order_group() -> None:
    shape = Shape()
    batch = make_batch([(c, 1) for c in (200, 230, 255, 180)], shape, seed=31)
    plan = make_backend(shape).prepare(batch.metadata).plan
    (group,) = plan.batched
    assert group.query_rows is None and group.result_index is None and not plan.looped
    check_backend(make_backend(shape), batch, shape)


def test_forward_without_prepare_is_refused() -> None:
    shape = Shape()
    batch = make_batch(DECODE, shape)
    with pytest.raises(RuntimeError, match="prepare"):
        make_backend(shape).forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                                    params_for(shape, 0.25))


def test_cache_of_wrong_shape_is_refused() -> None:
    shape = Shape()
    batch = make_batch(DECODE, shape)
    backend = make_backend(shape)
    metadata = backend.prepare(batch.metadata)
    wrong = batch.kv_cache.transpose(3, 4).contiguous()
    with pytest.raises(ValueError, match="kv_cache shape"):
        backend.forward(batch.query, batch.key, batch.value, wrong, metadata, params_for(shape, 0.25))


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
