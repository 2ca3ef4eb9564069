"""The Triton backend on a tiny mixed batch vs dense attention computed from the full K/V."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.attention import AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda.testing.attention import CONFORMANCE_CASES, ConformanceCase, UnsupportedCaseError, run_case
from pagoda_attn_triton import plugin
from pagoda_attn_triton.backend import TritonPagedAttentionBackend
from pagoda_kernels import reshape_and_cache_torch
from pagoda_kernels.dispatch import interpret_mode
from pagoda_kernels.testing import make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _spec(**overrides: object) -> AttentionSpec:
    fields: dict[str, object] = dict(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
        device_type="cuda", block_size=BLOCK_SIZE,
    )
    fields.update(overrides)
    return AttentionSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def runnable() -> None:
    if DEVICE == "cpu" and not interpret_mode():
        pytest.skip("no GPU and TRITON_INTERPRET is off")


# The shared cases put batch-padding rows *inside* num_tokens (slot -1, past the last
# sequence), as torch_paged and cpu_paged accept; triton_paged treats every row below
# num_tokens as a token of a sequence (its padding rows lie past num_tokens, and graph
# replays pad with one-token dummy sequences instead). Not strict: what those rows hold comes from
# memory the kernel never writes, so a run can match the reference by chance (CI saw
# padding-rows-mixed pass once in session 9 with no change to the backend).
_PADDING_INSIDE_NUM_TOKENS = pytest.mark.xfail(
    strict=False, raises=(AssertionError, ValueError),
    reason="triton_paged computes rows below num_tokens that belong to no sequence",
)
_KNOWN_DIVERGENCES = {"padding-rows-mixed", "padding-rows-decode", "only-padding-rows"}


@pytest.mark.usefixtures("runnable")
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=_PADDING_INSIDE_NUM_TOKENS) if c.id in _KNOWN_DIVERGENCES else c
     for c in CONFORMANCE_CASES if not c.alibi],
    ids=str,
)
def test_conformance(case: ConformanceCase) -> None:
    """The cases every backend runs (pagoda.testing.attention); on a CPU-only machine through
    Triton's interpreter, with the spec still saying CUDA."""
    run_case(case, TritonPagedAttentionBackend, device=DEVICE, device_type="cuda")


def test_alibi_is_refused_so_the_selector_picks_another_backend() -> None:
    for case in (c for c in CONFORMANCE_CASES if c.alibi):
        with pytest.raises(UnsupportedCaseError, match="ALiBi"):
            run_case(case, TritonPagedAttentionBackend, device="cpu", device_type="cuda")


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
           window: int | None, cap: float | None) -> torch.Tensor:
    """Queries [n, H, D] at ``positions`` over keys [L, Hkv, D] at 0..L-1, one head at a time."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        j = torch.arange(k.shape[0])
        allowed = j[None, :] <= positions[:, None]
        if window is not None:
            allowed &= j[None, :] > positions[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = (torch.softmax(scores, -1) @ v[:, h // group].double()).to(q.dtype)
    return out


def _run_step(seq_lens: list[int], query_lens: list[int], window: int | None, cap: float | None,
              dtype: torch.dtype = torch.float32, padding_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(seq_lens))
    batch = make_paged_batch(seq_lens, query_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, generator=g)
    full_k = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s in seq_lens]
    full_q = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g).to(dtype) for q in query_lens]
    # The cached prefixes are already in the cache from earlier steps.
    for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(s - q)
        slots = batch.block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        reshape_and_cache_torch(full_k[i][: s - q], full_v[i][: s - q], batch.kv_cache, slots)

    new_k = torch.cat([k[s - q:] for k, s, q in zip(full_k, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([v[s - q:] for v, s, q in zip(full_v, seq_lens, query_lens, strict=True)])
    query = torch.cat(full_q)
    slot_mapping = batch.slot_mapping
    if padding_rows:
        query = torch.cat([query, torch.zeros(padding_rows, NUM_HEADS, HEAD_DIM, dtype=dtype)])
        new_k = torch.cat([new_k, torch.zeros(padding_rows, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)])
        new_v = torch.cat([new_v, torch.zeros(padding_rows, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)])
        slot_mapping = torch.cat([slot_mapping, torch.full((padding_rows,), -1, dtype=torch.int64)])
    metadata = AttentionMetadata(
        num_seqs=len(seq_lens), num_tokens=batch.num_tokens,
        query_start_loc=batch.query_start_loc.to(DEVICE), seq_lens=batch.seq_lens.to(DEVICE),
        block_tables=batch.block_tables.to(DEVICE), slot_mapping=slot_mapping.to(DEVICE),
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        is_all_decode=all(q == 1 for q in query_lens),
    )
    backend = TritonPagedAttentionBackend(_spec(dtype=dtype, sliding_window=window, logits_soft_cap=cap))
    metadata = backend.prepare(metadata)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = backend.forward(query.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE), batch.kv_cache.to(DEVICE),
                          metadata, AttentionLayerParams(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale, window, cap)).cpu()
    want = torch.cat([
        _dense(q, k, v, torch.arange(s - q.shape[0], s), scale, window, cap)
        for q, k, v, s in zip(full_q, full_k, full_v, seq_lens, strict=True)
    ])
    if padding_rows:
        assert torch.equal(out[batch.num_tokens:], torch.zeros_like(out[batch.num_tokens:]))
    return out[: batch.num_tokens], want


@pytest.mark.usefixtures("runnable")
@pytest.mark.parametrize("window,cap", [(None, None), (4, None), (None, 3.0)], ids=["plain", "window", "softcap"])
def test_mixed_batch_matches_dense(window: int | None, cap: float | None) -> None:
    # A prefill chunk over a 6-token cached prefix, a fresh prefill, two decodes.
    got, want = _run_step([11, 5, 10, 1], [5, 5, 1, 1], window, cap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("runnable")
def test_all_decode_step_matches_dense() -> None:
    got, want = _run_step([40, 3, 17], [1, 1, 1], None, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("runnable")
def test_bf16_and_padding_rows() -> None:
    # bf16: both sides round to bf16 once at the end; ~1-2 ulps of bf16.
    got, want = _run_step([9, 6], [3, 1], None, None, torch.bfloat16, padding_rows=2)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_reasons_unsupported() -> None:
    assert TritonPagedAttentionBackend.reasons_unsupported(_spec()) == []
    reasons = TritonPagedAttentionBackend.reasons_unsupported(_spec(device_type="cpu"))
    assert any("needs a CUDA/ROCm device" in r for r in reasons)
    reasons = TritonPagedAttentionBackend.reasons_unsupported(_spec(head_dim=512, num_heads=3, dtype=torch.int8))
    assert len(reasons) == 3


def test_plugin_registers_the_backend() -> None:
    assert plugin.PAGODA_PLUGIN_API_VERSION == "1.0"
    (spec,) = plugin.pagoda_register_attention_backends()
    assert spec.name == "triton_paged" and spec.device_types == ("cuda",)
    assert spec.load() is TritonPagedAttentionBackend


def test_bidirectional_attention_is_refused() -> None:
    from dataclasses import replace

    spec = replace(_SPEC_FOR_REFUSALS, causal=False)
    assert any("bidirectional" in r for r in TritonPagedAttentionBackend.reasons_unsupported(spec))
    assert not any("bidirectional" in r for r in TritonPagedAttentionBackend.reasons_unsupported(_SPEC_FOR_REFUSALS))


_SPEC_FOR_REFUSALS = AttentionSpec(
    num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device_type="cuda", block_size=16
)
