"""Core's shared attention pieces: layer params, typed prepared metadata, layout checks, and the torch
prefill path (``pagoda.attention.prefill`` over ``pagoda.attention.sdpa``) against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagoda.attention import Attention, AttentionLayerParams, AttentionMetadata
from pagoda.attention.checks import check_kv_cache, layout_reasons
from pagoda.attention.kv_quant import dequantize_kv, quantize_kv
from pagoda.attention.prefill import PrefillSequence, prefill_attention
from pagoda.attention.sdpa import attend, causal_mask
from pagoda.attention.workspace import Workspace
from pagoda.layers.alibi import get_alibi_slopes
from pagoda.testing.attention import (
    DenseTestBackend,
    Shape,
    assert_within_tolerance,
    make_batch,
    params_for,
    reference_attention,
    spec_for,
)

SHAPE = Shape(num_heads=6, num_kv_heads=2, head_dim=16, block_size=8)


def test_layer_params_are_checked_once_where_they_are_built() -> None:
    good = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.25)
    AttentionLayerParams(**good)
    for bad, needle in (
        (dict(num_kv_heads=3), "multiple"),
        (dict(head_dim=0), "positive"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
        (dict(alibi_slopes=torch.ones(3)), "one slope per head"),
        (dict(k_scale=torch.tensor(1.0)), "both k_scale and v_scale"),
    ):
        with pytest.raises(ValueError, match=needle):
            AttentionLayerParams(**{**good, **bad})  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        AttentionLayerParams(**good).scale = 1.0  # type: ignore[misc]


def test_attention_layer_builds_its_params_at_bind() -> None:
    slopes = get_alibi_slopes(4)
    layer = Attention(num_heads=4, head_dim=8, scale=0.25, num_kv_heads=2, sliding_window=5, alibi_slopes=slopes)
    spec = spec_for(Shape(num_heads=4, num_kv_heads=2, head_dim=8), alibi_slopes=tuple(slopes.tolist()))
    plain = torch.zeros(2, 3, 16, 2, 8)
    layer.bind(DenseTestBackend(spec), plain)
    p = layer.params
    assert (p.num_heads, p.num_kv_heads, p.head_dim, p.scale, p.sliding_window) == (4, 2, 8, 0.25, 5)
    assert p.alibi_slopes is layer.alibi_slopes and p.k_scale is None and p.v_scale is None
    layer.bind(DenseTestBackend(spec), torch.zeros(2, 3, 16, 2, 8, dtype=torch.float8_e4m3fn))
    # the very tensors calculate_kv_scales and load_kv_scale update in place
    assert layer.params.k_scale is layer._k_scale and layer.params.v_scale is layer._v_scale
    layer.load_kv_scale("k", 0.5)
    assert float(layer.params.k_scale) == 0.5  # type: ignore[arg-type]
    # the transformers fallback sets its module's scale per call: the params follow
    layer.scale = 0.125
    assert layer.params.scale == 0.125 and layer.params.k_scale is layer._k_scale


@dataclass(kw_only=True)
class _Prepared(AttentionMetadata):
    note: str


@dataclass(kw_only=True)
class _OtherPrepared(AttentionMetadata):
    count: int


def test_from_common_copies_the_layout_and_adds_the_backends_fields() -> None:
    common = make_batch([(3, 1), (0, 5)], SHAPE).metadata
    prepared = _Prepared.from_common(common, note="planned")
    assert type(prepared) is _Prepared and prepared.note == "planned"
    for name in ("num_seqs", "num_tokens", "query_start_loc", "seq_lens", "block_tables", "slot_mapping",
                 "max_query_len", "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu", "is_all_decode"):
        assert getattr(prepared, name) is getattr(common, name), name
    # from an already prepared one: the layout only, not the other backend's fields
    again = _OtherPrepared.from_common(prepared, count=2)
    assert again.count == 2 and not hasattr(again, "note") and again.slot_mapping is common.slot_mapping
    with pytest.raises(TypeError):
        _Prepared.from_common(common)  # the backend's fields are required


def test_layout_reasons() -> None:
    assert layout_reasons(spec_for(SHAPE)) == []
    cases = {
        "multiple of num_kv_heads": spec_for(Shape(num_heads=5, num_kv_heads=2)),
        "positive": spec_for(Shape(num_heads=0)),
        "block_size": spec_for(Shape(block_size=0)),
        "sliding_window": spec_for(SHAPE, sliding_window=-2),
        "logits_soft_cap": spec_for(SHAPE, logits_soft_cap=0.0),
        "bidirectional": spec_for(SHAPE, causal=False, sliding_window=4),
        "ALiBi slopes": spec_for(SHAPE, alibi_slopes=(1.0, 2.0)),
    }
    for needle, spec in cases.items():
        reasons = layout_reasons(spec)
        assert len(reasons) == 1 and needle in reasons[0], (needle, reasons)


def test_check_kv_cache() -> None:
    key = torch.zeros(3, 2, 16)
    check_kv_cache(torch.zeros(2, 4, 8, 2, 16), 8, key)
    with pytest.raises(ValueError, match="kv_cache shape"):
        check_kv_cache(torch.zeros(2, 4, 16, 2, 8), 8, key)
    with pytest.raises(ValueError, match="contiguous"):
        check_kv_cache(torch.zeros(2, 8, 4, 2, 16).transpose(1, 2), 8, key)


def test_workspace_reuses_a_buffer_while_it_fits() -> None:
    ws = Workspace()
    a = ws.buffer("k", (2, 3), torch.float32, torch.device("cpu"))
    assert ws.buffer("k", (2, 3), torch.float32, torch.device("cpu")) is a
    assert ws.buffer("k", (2, 4), torch.float32, torch.device("cpu")) is not a
    assert ws.buffer("k", (2, 4), torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


def _written(lens: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0):  # type: ignore[no-untyped-def]
    """A batch whose new K/V are already in the cache (prefill_attention runs after the write)."""
    batch = make_batch(lens, SHAPE, dtype, seed=seed)
    flat = batch.kv_cache.view(2, -1, SHAPE.num_kv_heads, SHAPE.head_dim)
    flat[0, batch.metadata.slot_mapping] = batch.key
    flat[1, batch.metadata.slot_mapping] = batch.value
    return batch


def _sequences(batch) -> list[PrefillSequence]:  # type: ignore[no-untyped-def]
    starts = batch.metadata.query_start_loc.tolist()
    bs = SHAPE.block_size
    return [
        PrefillSequence(starts[i], starts[i + 1], s.context_len, s.seq_len,
                        batch.metadata.block_tables[i, : -(-s.seq_len // bs)].long())
        for i, s in enumerate(batch.sequences)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "window,cap,alibi", [(None, None, False), (7, None, False), (None, 2.0, False), (5, 3.0, True), (None, None, True)],
    ids=["plain", "window", "softcap", "window-softcap-alibi", "alibi"],
)
def test_prefill_attention_matches_the_reference(dtype: torch.dtype, window: int | None, cap: float | None,
                                                 alibi: bool) -> None:
    """Fresh prefills (read from key/value) and chunks on a cached prefix (gathered from the cache)."""
    batch = _written([(0, 19), (13, 9), (30, 1), (0, 2)], dtype, seed=3)
    slopes = get_alibi_slopes(SHAPE.num_heads) if alibi else None
    params = params_for(SHAPE, None, window, cap, alibi_slopes=slopes)
    workspace = Workspace()
    for index, (seq, ref) in enumerate(zip(_sequences(batch), batch.sequences, strict=True)):
        out = prefill_attention(batch.query, batch.key, batch.value, batch.kv_cache, seq, index, params, workspace)
        expected = reference_attention(ref, params.scale, window, cap, slopes)
        assert_within_tolerance(out, expected, dtype, f"sequence {index}")


def test_prefill_attention_reads_an_fp8_cache_back_dequantized() -> None:
    batch = _written([(0, 21), (11, 6)], seed=4)
    k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.05)
    cache = torch.empty(batch.kv_cache.shape, dtype=torch.float8_e4m3fn)
    cache[0], cache[1] = quantize_kv(batch.kv_cache[0], cache.dtype, k_scale), quantize_kv(batch.kv_cache[1], cache.dtype, v_scale)
    params = params_for(SHAPE, k_scale=k_scale, v_scale=v_scale)
    for index, (seq, ref) in enumerate(zip(_sequences(batch), batch.sequences, strict=True)):
        out = prefill_attention(batch.query, batch.key, batch.value, cache, seq, index, params, Workspace())
        ref.keys = dequantize_kv(quantize_kv(ref.keys, cache.dtype, k_scale), torch.float64, k_scale)
        ref.values = dequantize_kv(quantize_kv(ref.values, cache.dtype, v_scale), torch.float64, v_scale)
        assert_within_tolerance(out, reference_attention(ref, params.scale), torch.float32, f"sequence {index}")
    with pytest.raises(ValueError, match="k_scale"):
        prefill_attention(batch.query, batch.key, batch.value, cache, _sequences(batch)[0], 0, params_for(SHAPE),
                          Workspace())


def test_attend_causal_flag_equals_its_mask() -> None:
    """SDPA's is_causal and the explicit causal mask (the queries the last q of k positions) agree."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((6, 9), (2, 9), (2, 9)))
    by_flag = attend(q, k, v, None, 0.25, None, causal=True)
    by_mask = attend(q, k, v, lambda dtype: causal_mask(9, 9, q.device).to(dtype), 0.25, None, causal=False)
    torch.testing.assert_close(by_flag, by_mask)
    # the explicit float32 path (a soft cap) with a huge cap is the SDPA path
    torch.testing.assert_close(attend(q, k, v, None, 0.25, 1e9, causal=True), by_flag, atol=1e-5, rtol=1e-5)
