"""pagoda.testing.attention: the shared backend cases pass on a correct backend and catch broken ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagoda.attention import AttentionMetadata, AttentionSpec
from pagoda.testing.attention import (
    CONFORMANCE_CASES,
    ConformanceCase,
    DenseTestBackend,
    UnsupportedCaseError,
    run_case,
)


@pytest.mark.parametrize("case", CONFORMANCE_CASES, ids=str)
def test_dense_test_backend_passes_every_case(case: ConformanceCase) -> None:
    """The backend model-family tests bind (pagoda.testing.paged_kv) is held to the same cases."""
    run_case(case, DenseTestBackend)


def test_cases_cover_the_contract() -> None:
    ids = [c.id for c in CONFORMANCE_CASES]
    assert len(ids) == len(set(ids))
    kinds = {c.kind for c in CONFORMANCE_CASES}
    assert kinds == {"step", "slot_skipped", "layers_share_prepare", "padding_only", "strided_query"}
    assert {torch.float32, torch.bfloat16, torch.float16} <= {c.dtype for c in CONFORMANCE_CASES}
    assert any(c.sliding_window for c in CONFORMANCE_CASES) and any(c.logits_soft_cap for c in CONFORMANCE_CASES)
    assert any(c.padding_rows for c in CONFORMANCE_CASES)
    assert {c.dtype for c in CONFORMANCE_CASES if c.alibi} == {torch.float32, torch.bfloat16}
    assert {c.shape.block_size for c in CONFORMANCE_CASES} == {8, 16}


class IgnoresTheWindow(DenseTestBackend):
    name = "ignores-window"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        return super().forward(query, key, value, kv_cache, metadata, replace(params, sliding_window=None))


class WritesSkippedSlots(DenseTestBackend):
    """Treats slot -1 as a Python index (the last slot of the cache) instead of skipping it."""

    name = "writes-skipped-slots"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        kv_cache[0].view(-1, key.shape[1], key.shape[2])[metadata.slot_mapping] = key
        return super().forward(query, key, value, kv_cache, metadata, params)


class GarbagePadding(DenseTestBackend):
    name = "garbage-padding"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        out = super().forward(query, key, value, kv_cache, metadata, params)
        out[int(metadata.query_start_loc[-1]) :] = 1.0
        return out


class IgnoresAlibi(DenseTestBackend):
    name = "ignores-alibi"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        return super().forward(query, key, value, kv_cache, metadata, replace(params, alibi_slopes=None))


class AlibiSignFlipped(DenseTestBackend):
    """slope * (q_pos - k_pos): favours distant keys instead of near ones."""

    name = "alibi-sign-flipped"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        slopes = params.alibi_slopes
        flipped = replace(params, alibi_slopes=None if slopes is None else -slopes)
        return super().forward(query, key, value, kv_cache, metadata, flipped)


class AlibiPerKvHead(DenseTestBackend):
    """Takes the slope of the query head's KV head (wrong under GQA: slopes are per query head)."""

    name = "alibi-per-kv-head"

    def forward(self, query, key, value, kv_cache, metadata, params):  # type: ignore[no-untyped-def]
        slopes = params.alibi_slopes
        if slopes is not None:
            group = query.shape[1] // key.shape[1]
            params = replace(params, alibi_slopes=slopes[::group].repeat_interleave(group))
        return super().forward(query, key, value, kv_cache, metadata, params)


class NoHalfPrecision(DenseTestBackend):
    name = "fp32-only"

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        return [] if spec.dtype == torch.float32 else [f"dtype {spec.dtype} is not float32"]


def _case(case_id: str) -> ConformanceCase:
    (case,) = [c for c in CONFORMANCE_CASES if c.id == case_id]
    return case


@pytest.mark.parametrize(
    ("backend", "case_id", "message"),
    [
        (IgnoresTheWindow, "window8-mixed", "sequence"),
        (WritesSkippedSlots, "padding-rows-decode", "sequence|KV cache"),
        (WritesSkippedSlots, "slot-minus-one-inside-a-sequence", "slot of -1"),
        (GarbagePadding, "padding-rows-mixed", "padding rows"),
        (IgnoresAlibi, "alibi-mixed", "sequence"),
        (AlibiSignFlipped, "alibi-decode", "sequence"),
        (AlibiPerKvHead, "alibi-chunked", "sequence"),
    ],
)
def test_a_broken_backend_fails_its_case(backend: type[DenseTestBackend], case_id: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_case(_case(case_id), backend)


def test_an_unsupported_case_fails_unless_skipping_is_asked_for() -> None:
    case = _case("bf16-plain")
    with pytest.raises(UnsupportedCaseError, match="fp32-only does not serve case bf16-plain: dtype"):
        run_case(case, NoHalfPrecision)
    with pytest.raises(pytest.skip.Exception, match="dtype"):
        run_case(case, NoHalfPrecision, skip_unsupported=True)


def test_device_type_is_what_the_spec_tells_the_backend() -> None:
    seen: list[str] = []

    class Recording(DenseTestBackend):
        def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
            seen.append(self.spec.device_type)
            return metadata

    run_case(_case("decode-block16"), Recording, device_type="fake-accelerator")
    assert seen == ["fake-accelerator"]
