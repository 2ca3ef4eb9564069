import pytest
import torch

from pagoda_kernels import reshape_and_cache, reshape_and_cache_torch


@pytest.mark.usefixtures("interpreted")
def test_triton_write_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 12  # head_dim not a power of two
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    expected = cache.clone()
    key = torch.randn(7, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(7, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([0, 5, -1, 23, 9, -1, 14])
    reshape_and_cache(key, value, cache, slots, impl="triton")
    reshape_and_cache_torch(key, value, expected, slots)
    assert torch.equal(cache, expected)
    # Skipped rows left their slots alone, written rows landed at block*size+offset.
    assert torch.equal(cache[0, 23 // block_size, 23 % block_size], key[3])
    assert torch.equal(cache[1, 9 // block_size, 9 % block_size], value[4])


@pytest.mark.usefixtures("interpreted")
def test_strided_key_value_views(dtype: torch.dtype) -> None:
    # K and V are often views into one fused QKV projection output.
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 2 * 16, generator=g).to(dtype)
    _, key, value = qkv.view(5, 3, 2, 16).unbind(1)
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=dtype)
    expected = cache.clone()
    slots = torch.tensor([1, 2, 3, 10, 11], dtype=torch.int32)
    reshape_and_cache(key, value, cache, slots, impl="triton")
    reshape_and_cache_torch(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_bad_shapes_are_named() -> None:
    cache = torch.zeros(2, 3, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(torch.zeros(5, 2, 16), torch.zeros(5, 2, 16), cache, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_kv_heads"):
        reshape_and_cache(torch.zeros(5, 3, 16), torch.zeros(5, 3, 16), cache, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache must be"):
        reshape_and_cache(torch.zeros(5, 2, 16), torch.zeros(5, 2, 16), cache[0], torch.zeros(5, dtype=torch.int64))
