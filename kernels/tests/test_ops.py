"""The custom ops: callable through torch.ops, and traceable with fake tensors."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pagoda_kernels.ops  # noqa: F401  (registers torch.ops.pagoda_kernels.*)
from pagoda_kernels import paged_decode_attention_torch, reshape_and_cache_torch, silu_and_mul_torch
from pagoda_kernels.testing import make_paged_batch

ops = torch.ops.pagoda_kernels


def test_ops_run_like_the_functions() -> None:
    g = torch.Generator().manual_seed(0)
    batch = make_paged_batch([5, 9], [1, 1], 2, 16, 4, generator=g)
    key = torch.randn(2, 2, 16, generator=g)
    value = torch.randn(2, 2, 16, generator=g)
    expected_cache = batch.kv_cache.clone()
    ops.reshape_and_cache(key, value, batch.kv_cache, batch.slot_mapping)
    reshape_and_cache_torch(key, value, expected_cache, batch.slot_mapping)
    assert torch.equal(batch.kv_cache, expected_cache)

    query = torch.randn(2, 4, 16, generator=g)
    got = ops.paged_decode_attention(query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.25, None, 3.0)
    want = paged_decode_attention_torch(query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.25, None, 3.0)
    torch.testing.assert_close(got, want)
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_torch(x))


def test_fake_implementations_give_output_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(3, 10)
        assert ops.silu_and_mul(x).shape == (3, 5)
        out, summed = ops.fused_add_rms_norm(x, torch.empty(3, 10), torch.empty(10), 1e-6)
        assert out.shape == summed.shape == (3, 10)
        q, k = ops.rotary_embedding(torch.empty(3, dtype=torch.long), torch.empty(3, 32), torch.empty(3, 16), 16,
                                    torch.empty(8, 16), True)
        assert q.shape == (3, 32) and k.shape == (3, 16)
        attn = ops.paged_prefill_attention(torch.empty(3, 4, 16), torch.empty(2, 5, 4, 2, 16),
                                           torch.empty(1, 5, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                           torch.empty(1, dtype=torch.int32), 0.25, None, None, None)
        assert attn.shape == (3, 4, 16)
