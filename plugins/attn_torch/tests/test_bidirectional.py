"""Bidirectional attention (``AttentionSpec.causal=False``, encoder-only models) in torch_paged and the dense test backend."""

from __future__ import annotations

import pytest
import torch

from pagoda.testing.attention import DenseTestBackend
from pagoda.testing.attention.batch import Shape, make_batch, params_for, spec_for
from pagoda_attn_torch.backend import TorchPagedAttentionBackend

SHAPE = Shape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
CASES = {
    # equal lengths, contiguous: one dense run covering the batch
    "one_run": [(0, 20), (0, 20), (0, 20)],
    # runs of different lengths, and a one-token prompt
    "runs": [(0, 7), (0, 7), (0, 33), (0, 1), (0, 1), (0, 40)],
    # a sequence on top of cached tokens: read back from the cache under a full mask
    "with_context": [(0, 9), (24, 8), (0, 9), (5, 1)],
}


def bidirectional_reference(seq, scale: float) -> torch.Tensor:
    q = seq.query.double()
    group = q.shape[1] // seq.keys.shape[1]
    k = seq.keys.double().repeat_interleave(group, dim=1)
    v = seq.values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("backend_cls", [TorchPagedAttentionBackend, DenseTestBackend], ids=["torch_paged", "dense"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("padding_rows", [0, 3])
def test_bidirectional_matches_reference(backend_cls: type, case: str, padding_rows: int) -> None:
    batch = make_batch(CASES[case], SHAPE, padding_rows=padding_rows)
    backend = backend_cls(spec_for(SHAPE, causal=False))
    md = backend.prepare(batch.metadata)
    scale = SHAPE.head_dim**-0.5
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, md, params_for(SHAPE, scale))
    starts = batch.metadata.query_start_loc.tolist()
    for i, seq in enumerate(batch.sequences):
        got = out[starts[i] : starts[i + 1]]
        torch.testing.assert_close(got.double(), bidirectional_reference(seq, scale), atol=1e-5, rtol=1e-5)
    if padding_rows:
        assert bool((out[starts[-1] :] == 0).all())
    # and the causal answer differs (the flag is read)
    causal = backend_cls(spec_for(SHAPE))
    md = causal.prepare(make_batch(CASES[case], SHAPE, padding_rows=padding_rows).metadata)
    again = make_batch(CASES[case], SHAPE, padding_rows=padding_rows)
    causal_out = causal.forward(again.query, again.key, again.value, again.kv_cache, md, params_for(SHAPE, scale))
    assert not torch.allclose(causal_out[: starts[-1]], out[: starts[-1]], atol=1e-3)


def test_sliding_window_with_bidirectional_is_refused() -> None:
    reasons = TorchPagedAttentionBackend.reasons_unsupported(spec_for(SHAPE, causal=False, sliding_window=8))
    assert any("bidirectional" in r for r in reasons)


def test_cpu_paged_refuses_bidirectional() -> None:
    backend = pytest.importorskip("pagoda_attn_cpu.backend")
    reasons = backend.CpuPagedAttentionBackend.reasons_unsupported(spec_for(SHAPE, causal=False))
    assert any("causal=False" in r for r in reasons)
