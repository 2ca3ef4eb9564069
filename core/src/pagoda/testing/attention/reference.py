"""The dense reference a paged attention backend must match, its tolerances, and the step check."""

from __future__ import annotations

import torch

from pagoda.attention.interface import AttentionBackend, AttentionMetadata
from pagoda.testing.attention.batch import Batch, Sequence, Shape, params_for

# Against a float64 reference. The half-precision bounds allow for inputs and
# outputs rounded to the dtype (a backend may accumulate in float32 or better).
TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


def reference_attention(
    seq: Sequence,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense float64 attention of one sequence's new tokens over its whole K/V.

    ``alibi_slopes``: head h's logits get ``alibi_slopes[h] * (key_pos - query_pos)`` after the soft cap.
    """
    q = seq.query.double()  # [q, h, d]
    group = q.shape[1] // seq.keys.shape[1]
    k = seq.keys.double().repeat_interleave(group, dim=1)  # [s, h, d]
    v = seq.values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    positions = torch.arange(seq.context_len, seq.seq_len).unsqueeze(1)
    keys = torch.arange(seq.seq_len).unsqueeze(0)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.double().view(-1, 1, 1) * (keys - positions).double()
    allowed = keys <= positions
    if sliding_window is not None:
        allowed &= keys > positions - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def assert_within_tolerance(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, where: str = "") -> None:
    """``got`` (any dtype) against the float64 ``expected`` within ``TOLERANCE[dtype]``."""
    tolerance = TOLERANCE[dtype]

    def message(detail: str) -> str:
        return f"{where}: {detail}" if where else detail

    torch.testing.assert_close(
        got.double(), expected, atol=tolerance["atol"], rtol=tolerance["rtol"], msg=message
    )


def metadata_to(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of ``metadata``'s layout with its device tensors on ``device`` (host copies stay on the host);
    a backend prepares it for the step."""
    return AttentionMetadata(
        num_seqs=metadata.num_seqs,
        num_tokens=metadata.num_tokens,
        query_start_loc=metadata.query_start_loc.to(device),
        seq_lens=metadata.seq_lens.to(device),
        block_tables=metadata.block_tables.to(device),
        slot_mapping=metadata.slot_mapping.to(device),
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        query_start_loc_cpu=metadata.query_start_loc_cpu,
        seq_lens_cpu=metadata.seq_lens_cpu,
        is_all_decode=metadata.is_all_decode,
    )


def check_output(
    out: torch.Tensor,
    batch: Batch,
    scale: float,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Every sequence's rows of ``out`` against the dense reference; padding rows must be zero."""
    assert out.shape == batch.query.shape, f"output shape {tuple(out.shape)} != query shape {tuple(batch.query.shape)}"
    assert out.dtype == dtype, f"output dtype {out.dtype} != {dtype}"
    out = out.cpu()
    row = 0
    for i, seq in enumerate(batch.sequences):
        expected = reference_attention(seq, scale, sliding_window, logits_soft_cap, alibi_slopes)
        got = out[row : row + seq.query_len].double()
        assert_within_tolerance(got, expected, dtype, f"sequence {i} ({seq.context_len} cached + {seq.query_len} new)")
        row += seq.query_len
    assert torch.equal(out[row:], torch.zeros_like(out[row:])), "padding rows must come out as zeros"


def check_cache(batch: Batch, shape: Shape) -> None:
    """Every sequence's tokens sit at their slots; every other slot is untouched."""
    expected = batch.initial_cache.clone()
    bs = shape.block_size
    for seq in batch.sequences:
        for t in range(seq.seq_len):
            expected[0, seq.blocks[t // bs], t % bs] = seq.keys[t]
            expected[1, seq.blocks[t // bs], t % bs] = seq.values[t]
    assert torch.equal(batch.kv_cache.cpu(), expected), "the KV cache differs from the step's writes"


def run_and_check(
    backend: AttentionBackend,
    batch: Batch,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    device: torch.device | str | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step through ``backend``: every sequence's output against the dense reference,
    padding rows zero, and the new K/V at their slots with nothing else in the cache touched.

    ``alibi_slopes``: [num_heads] float32 ALiBi slopes (the layer params' ``alibi_slopes``).
    ``device``: where the step's tensors go (default: stay on the host). The batch's
    cache is replaced by the one the backend wrote, so later checks see it.
    """
    metadata = batch.metadata
    query, key, value = batch.query, batch.key, batch.value
    if device is not None:
        device = torch.device(device)
        metadata = metadata_to(metadata, device)
        query, key, value = query.to(device), key.to(device), value.to(device)  # no copy when already there
        batch.kv_cache = batch.kv_cache.to(device)
    metadata = backend.prepare(metadata)
    slopes = None if alibi_slopes is None else alibi_slopes.to(query.device)
    params = params_for(shape, None, sliding_window, logits_soft_cap, alibi_slopes=slopes)
    out = backend.forward(query, key, value, batch.kv_cache, metadata, params)
    check_output(out, batch, params.scale, dtype, sliding_window, logits_soft_cap, alibi_slopes)
    check_cache(batch, shape)
    return out
