"""The cases every paged attention backend must pass, and how one case runs.

A backend's own tests run them all with one parametrized test::

    import pytest
    from pagoda.testing.attention import CONFORMANCE_CASES, run_case

    @pytest.mark.parametrize("case", CONFORMANCE_CASES, ids=str)
    def test_conformance(case):
        run_case(case, MyBackend)

Each case is one step (or a few layers of one step) built from explicit K/V and
checked against a float64 dense reference: outputs per sequence, padding rows
zero, and the KV cache written at the step's slots and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from pagoda.attention.interface import AttentionBackend, AttentionMetadata
from pagoda.layers.alibi import get_alibi_slopes
from pagoda.testing.attention.batch import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    Batch,
    Shape,
    make_batch,
    params_for,
    spec_for,
)
from pagoda.testing.attention.reference import (
    assert_within_tolerance,
    check_cache,
    metadata_to,
    reference_attention,
    run_and_check,
)

CaseKind = Literal["step", "slot_skipped", "layers_share_prepare", "padding_only", "strided_query"]


@dataclass(frozen=True)
class ConformanceCase:
    """One conformance check; ``kind`` says which (a plain step unless stated)."""

    id: str
    lens: tuple[tuple[int, int], ...] = ()  # (cached tokens, new tokens) per sequence
    shape: Shape = field(default_factory=Shape)
    dtype: torch.dtype = torch.float32
    seed: int = 0
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    # Queries are multiplied by this so a soft cap actually bends the logits.
    query_scale: float = 1.0
    padding_rows: int = 0
    kind: CaseKind = "step"
    # ALiBi with get_alibi_slopes(num_heads): the spec carries the slopes, forward gets them
    alibi: bool = False

    def __str__(self) -> str:
        return self.id

    def alibi_slopes(self) -> torch.Tensor | None:
        return get_alibi_slopes(self.shape.num_heads) if self.alibi else None


class UnsupportedCaseError(AssertionError):
    """The backend's ``reasons_unsupported`` refuses a conformance case it was expected to serve."""


def _cases() -> list[ConformanceCase]:
    C = ConformanceCase
    cases: list[ConformanceCase] = []
    for block_size in (16, 8):
        shape = Shape(block_size=block_size)
        cases += [
            C(f"prefill-block{block_size}", tuple(PREFILL), shape, seed=1),
            C(f"chunked-prefill-block{block_size}", tuple(CHUNKED), shape, seed=2),
            C(f"decode-block{block_size}", tuple(DECODE), shape, seed=3),
            C(f"mixed-block{block_size}", tuple(MIXED), shape, seed=4),
        ]
    for label, heads, kv_heads, head_dim in (("4-2", 4, 2, 16), ("9-3", 9, 3, 64), ("mha", 4, 4, 16), ("mqa", 4, 1, 8)):
        shape = Shape(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        cases += [C(f"heads-{label}-mixed", tuple(MIXED), shape, seed=5), C(f"heads-{label}-decode", tuple(DECODE), shape, seed=6)]
    named = (("mixed", MIXED), ("prefill", PREFILL), ("decode", DECODE))
    for window in (1, 8, 21):
        cases += [C(f"window{window}-{n}", tuple(lens), Shape(block_size=8), seed=7, sliding_window=window) for n, lens in named]
    cases += [
        C(f"softcap-{n}", tuple(lens), Shape(num_heads=6, num_kv_heads=2), seed=8, logits_soft_cap=2.0, query_scale=4.0)
        for n, lens in named
    ]
    cases.append(C("softcap-window", tuple(MIXED), seed=9, sliding_window=10, logits_soft_cap=3.0))
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for cap in (None, 4.0):
            cases.append(
                C(f"{dname}-{'softcap' if cap else 'plain'}", tuple(MIXED + CHUNKED[:2]),
                  Shape(num_heads=9, num_kv_heads=3, head_dim=64), dtype, seed=10, logits_soft_cap=cap)
            )
    # ALiBi: per query head (GQA groups share K/V, not slopes), a non-power-of-two head count,
    # combined with a window and a soft cap, and in bfloat16
    cases += [C(f"alibi-{n}", tuple(lens), seed=14, alibi=True) for n, lens in (*named, ("chunked", CHUNKED))]
    cases += [
        C("alibi-heads-6-1-mixed", tuple(MIXED), Shape(num_heads=6, num_kv_heads=1, head_dim=32), seed=15, alibi=True),
        C("alibi-softcap-window", tuple(MIXED), Shape(block_size=8), seed=16, sliding_window=10, logits_soft_cap=3.0,
          query_scale=4.0, alibi=True),
        C("alibi-bf16", tuple(MIXED + CHUNKED[:2]), Shape(num_heads=8, num_kv_heads=2, head_dim=64), torch.bfloat16,
          seed=17, alibi=True),
    ]
    cases += [
        C(f"padding-rows-{n}", tuple(lens), Shape(block_size=8), seed=11, padding_rows=3)
        for n, lens in (("mixed", MIXED), ("decode", DECODE))
    ]
    cases += [
        C("slot-minus-one-inside-a-sequence", ((10, 1), (0, 20), (3, 4)), Shape(block_size=8), seed=12, kind="slot_skipped"),
        C("layers-share-one-prepare", (*MIXED, (0, 30)), seed=20, kind="layers_share_prepare"),
        C("only-padding-rows", kind="padding_only"),
        C("strided-query", tuple(MIXED), seed=13, kind="strided_query"),
    ]
    return cases


CONFORMANCE_CASES: list[ConformanceCase] = _cases()


def run_case(
    case: ConformanceCase,
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    device_type: str | None = None,
    skip_unsupported: bool = False,
) -> None:
    """Run ``case`` on a fresh ``backend_cls(spec)``; raises AssertionError on any mismatch.

    ``device``: where the step's tensors live. ``device_type``: what the spec tells
    the backend (default: ``device``'s type; e.g. "cuda" for a GPU backend run on
    host tensors under an interpreter). A case the backend declares unsupported
    (``reasons_unsupported``) fails with the reasons, or is skipped through pytest
    with ``skip_unsupported=True``.
    """
    device = torch.device(device)
    slopes = case.alibi_slopes()
    spec = spec_for(
        case.shape, case.dtype, device_type or device.type,
        sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
        alibi_slopes=None if slopes is None else tuple(slopes.tolist()),
    )
    reasons = backend_cls.reasons_unsupported(spec)
    if reasons:
        message = f"{backend_cls.name} does not serve case {case.id}: {'; '.join(reasons)}"
        if skip_unsupported:
            import pytest

            pytest.skip(message)
        raise UnsupportedCaseError(message)
    _RUNNERS[case.kind](case, backend_cls(spec), device)


def _batch(case: ConformanceCase, **overrides: int) -> Batch:
    fields = dict(dtype=case.dtype, seed=case.seed, padding_rows=case.padding_rows)
    batch = make_batch(list(case.lens), case.shape, **{**fields, **overrides})  # type: ignore[arg-type]
    if case.query_scale != 1.0:
        batch.scale_queries(case.query_scale)
    return batch


def _run_step(case: ConformanceCase, backend: AttentionBackend, device: torch.device) -> None:
    batch = _batch(case)
    if case.padding_rows:
        assert (batch.metadata.slot_mapping[-case.padding_rows :] == -1).all()
    if case.lens and all(q == 1 for _, q in case.lens):
        assert batch.metadata.is_all_decode
    run_and_check(backend, batch, case.shape, case.dtype, case.sliding_window, case.logits_soft_cap, device,
                  case.alibi_slopes())


def _run_strided_query(case: ConformanceCase, backend: AttentionBackend, device: torch.device) -> None:
    """Queries sliced out of a fused QKV projection (head_dim contiguous, tokens strided)."""
    batch = _batch(case)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1).to(device)
    batch.query = fused[:, : case.shape.num_heads]
    assert not batch.query.is_contiguous()
    run_and_check(backend, batch, case.shape, case.dtype, case.sliding_window, case.logits_soft_cap, device)


def _run_slot_skipped(case: ConformanceCase, backend: AttentionBackend, device: torch.device) -> None:
    """A slot of -1 on a real sequence's row (the first, a decode) is not written; the other rows are."""
    batch = _batch(case)
    slot = int(batch.metadata.slot_mapping[0])
    batch.metadata.slot_mapping[0] = -1
    cache = batch.kv_cache.to(device)
    metadata = backend.prepare(metadata_to(batch.metadata, device))
    backend.forward(batch.query.to(device), batch.key.to(device), batch.value.to(device), cache, metadata,
                    params_for(case.shape, 0.25))
    cache = cache.cpu()
    block, offset = divmod(slot, case.shape.block_size)
    assert torch.equal(cache[:, block, offset], batch.initial_cache[:, block, offset]), "a slot of -1 was written"
    written = batch.metadata.slot_mapping[1:]
    flat = cache.reshape(2, -1, case.shape.num_kv_heads, case.shape.head_dim)
    assert torch.equal(flat[0, written], batch.key[1:]), "the other rows' keys are not at their slots"
    assert torch.equal(flat[1, written], batch.value[1:]), "the other rows' values are not at their slots"
    expected = batch.initial_cache.reshape(flat.shape).clone()
    expected[0, written], expected[1, written] = batch.key[1:], batch.value[1:]
    assert torch.equal(flat, expected), "a slot of -1 was written somewhere else in the cache"


def _run_layers_share_prepare(case: ConformanceCase, backend: AttentionBackend, device: torch.device) -> None:
    """One ``prepare`` per step serves every layer, each with its own cache, window and inputs."""
    layers = [_batch(case, seed=case.seed + i, layout_seed=case.seed) for i in range(3)]
    metadata = backend.prepare(metadata_to(layers[0].metadata, device))
    scale = case.shape.head_dim**-0.5
    for batch, window in zip(layers, [None, 6, None], strict=True):
        batch.kv_cache = batch.kv_cache.to(device)
        out = backend.forward(
            batch.query.to(device), batch.key.to(device), batch.value.to(device), batch.kv_cache, metadata,
            params_for(case.shape, scale, window),
        ).cpu()
        row = 0
        for seq in batch.sequences:
            expected = reference_attention(seq, scale, window)
            assert_within_tolerance(out[row : row + seq.query_len], expected, case.dtype, f"layer with window {window}")
            row += seq.query_len
        check_cache(batch, case.shape)


def _run_padding_only(case: ConformanceCase, backend: AttentionBackend, device: torch.device) -> None:
    """A step of only padding rows (no sequences) returns zeros and writes nothing."""
    shape = case.shape
    gen = torch.Generator().manual_seed(case.seed)
    cache = torch.randn(2, 4, shape.block_size, shape.num_kv_heads, shape.head_dim, generator=gen).to(case.dtype)
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
        query_start_loc_cpu=torch.zeros(1, dtype=torch.int32),
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
    )
    q = torch.randn(2, shape.num_heads, shape.head_dim, generator=gen).to(case.dtype)
    k = torch.randn(2, shape.num_kv_heads, shape.head_dim, generator=gen).to(case.dtype)
    cache = cache.to(device)
    out = backend.forward(q.to(device), k.to(device), k.clone().to(device), cache,
                          backend.prepare(metadata_to(metadata, device)), params_for(shape, 0.25))
    assert torch.equal(out.cpu(), torch.zeros_like(q)), "padding rows must come out as zeros"
    assert torch.equal(cache.cpu(), before), "a step of only padding rows wrote to the cache"


_RUNNERS: dict[str, Callable[[ConformanceCase, AttentionBackend, torch.device], None]] = {
    "step": _run_step,
    "strided_query": _run_strided_query,
    "slot_skipped": _run_slot_skipped,
    "layers_share_prepare": _run_layers_share_prepare,
    "padding_only": _run_padding_only,
}
