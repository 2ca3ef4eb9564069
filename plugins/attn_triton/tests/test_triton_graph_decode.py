"""The Triton backend's decode path as a CUDA graph replay sees it.

Under a graph the runner prepares once per batch size with max_seq_len =
max_model_len and pads the batch with rows of slot -1, seq_len 1 over block 0.
Here (Triton interpreter on CPU, or a GPU) that layout must give the same real
rows as an ordinary eager decode step, with a different split-K fan-out, and
write nothing for the padding rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.attention import AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda_attn_triton.backend import TritonPagedAttentionBackend
from pagoda_kernels.dispatch import interpret_mode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
MAX_MODEL_LEN = 2048
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def runnable() -> None:
    if DEVICE == "cpu" and not interpret_mode():
        pytest.skip("no GPU and TRITON_INTERPRET is off")


def _backend() -> TritonPagedAttentionBackend:
    return TritonPagedAttentionBackend(AttentionSpec(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
        device_type="cuda", block_size=BLOCK_SIZE,
    ))


def test_backend_declares_graph_support() -> None:
    assert TritonPagedAttentionBackend.supports_cuda_graphs is True


@pytest.mark.parametrize("seq_lens", [[40], [5, 23, 9]], ids=["one_long", "three_short"])
def test_padded_static_decode_matches_eager(seq_lens: list[int]) -> None:
    g = torch.Generator().manual_seed(len(seq_lens))
    n = len(seq_lens)
    size = 1 << n.bit_length()  # the capture size this step pads to (> n: always some padding)
    width = MAX_MODEL_LEN // BLOCK_SIZE
    num_blocks = 1 + sum(-(-s // BLOCK_SIZE) for s in seq_lens)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
    cache[:, 0] = 0  # the null block
    # Static buffers of the graph: padding rows everywhere, then the real rows copied in.
    block_tables = torch.zeros(size, width, dtype=torch.int32)
    seq = torch.ones(size, dtype=torch.int32)
    slots = torch.full((size,), -1, dtype=torch.int64)
    next_block = 1
    for i, s in enumerate(seq_lens):
        nb = -(-s // BLOCK_SIZE)
        block_tables[i, :nb] = torch.arange(next_block, next_block + nb, dtype=torch.int32)
        next_block += nb
        seq[i] = s
        slots[i] = int(block_tables[i, (s - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (s - 1) % BLOCK_SIZE
    query = torch.randn(size, NUM_HEADS, HEAD_DIM, generator=g)
    key = torch.randn(size, NUM_KV_HEADS, HEAD_DIM, generator=g)
    value = torch.randn(size, NUM_KV_HEADS, HEAD_DIM, generator=g)
    scale = 1 / math.sqrt(HEAD_DIM)
    backend = _backend()

    def run(md_size: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        kv = cache.clone().to(DEVICE)
        md = AttentionMetadata(
            num_seqs=md_size, num_tokens=md_size,
            query_start_loc=torch.arange(md_size + 1, dtype=torch.int32, device=DEVICE),
            seq_lens=seq[:md_size].to(DEVICE), block_tables=block_tables[:md_size].to(DEVICE),
            slot_mapping=slots[:md_size].to(DEVICE), max_query_len=1, max_seq_len=max_seq_len, is_all_decode=True,
        )
        md = backend.prepare(md)
        out = backend.forward(query[:md_size].to(DEVICE), key[:md_size].to(DEVICE), value[:md_size].to(DEVICE),
                              kv, md, AttentionLayerParams(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale))
        assert md.num_splits is not None  # an all-decode step decides its fan-out in prepare
        return out.cpu(), kv.cpu(), md.num_splits

    graph_out, graph_kv, graph_splits = run(size, MAX_MODEL_LEN)
    eager_out, eager_kv, eager_splits = run(n, max(seq_lens))
    if len(seq_lens) == 1:
        # The upper bound fans out wider than the real length needs: some splits are empty.
        assert graph_splits > eager_splits
    torch.testing.assert_close(graph_out[:n], eager_out, rtol=1e-5, atol=1e-5)
    # The padding rows wrote nothing: the caches agree, the null block is still zero.
    torch.testing.assert_close(graph_kv, eager_kv)
    assert not graph_kv[:, 0].any()
    assert torch.isfinite(graph_out).all()
