import pytest
import torch

from pagoda_kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
    rotary_embedding,
    rotary_embedding_torch,
    silu_and_mul,
    silu_and_mul_torch,
)

pytestmark = pytest.mark.usefixtures("interpreted")


def test_rms_norm(dtype: torch.dtype, tol: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=g).to(dtype)  # hidden not a power of two
    w = torch.randn(40, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, impl="triton"), rms_norm_torch(x, w, 1e-5), **tol)


def test_fused_add_rms_norm(dtype: torch.dtype, tol: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=g).to(dtype)
    residual = torch.randn(5, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    out, summed = fused_add_rms_norm(x, residual, w, 1e-6, impl="triton")
    want_out, want_summed = fused_add_rms_norm_torch(x, residual, w, 1e-6)
    torch.testing.assert_close(summed, want_summed, **tol)
    torch.testing.assert_close(out, want_out, **tol)
    # The reference itself: the sum, normalised by its root mean square.
    s = x.float() + residual.float()
    direct = s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w.float()
    torch.testing.assert_close(want_out.float(), direct, **tol)


def _cos_sin_cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_rotary(dtype: torch.dtype, tol: dict[str, float], is_neox: bool, rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(2)
    head_size, num_tokens = 16, 5
    cache = _cos_sin_cache(32, rotary_dim)
    positions = torch.tensor([0, 3, 31, 7, 7])
    query = torch.randn(num_tokens, 3 * head_size, generator=g).to(dtype)  # flat heads, as projections give
    key = torch.randn(num_tokens, 1, head_size, generator=g).to(dtype)
    got_q, got_k = rotary_embedding(positions, query, key, head_size, cache, is_neox, impl="triton")
    want_q, want_k = rotary_embedding_torch(positions, query, key, head_size, cache, is_neox)
    assert got_q.shape == query.shape and got_k.shape == key.shape
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


def test_rotary_reference_is_a_rotation_by_position() -> None:
    # Neox style on one head: channels (i, i + d/2) rotate by angle pos * inv_freq[i]; position 0 is identity.
    cache = _cos_sin_cache(8, 4)
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    k = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    q0, _ = rotary_embedding_torch(torch.tensor([0]), q, k, 4, cache)
    torch.testing.assert_close(q0, q)
    q2, _ = rotary_embedding_torch(torch.tensor([2]), q, k, 4, cache)
    torch.testing.assert_close(q2, torch.tensor([[torch.cos(torch.tensor(2.0)), 0.0, torch.sin(torch.tensor(2.0)), 0.0]]))


def test_silu_and_mul(dtype: torch.dtype, tol: dict[str, float]) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 2 * 70, generator=g).to(dtype)  # d spans two column blocks in the interpreter
    got = silu_and_mul(x, impl="triton")
    assert got.shape == (2, 3, 70)
    torch.testing.assert_close(got, silu_and_mul_torch(x), **tol)
    gate, up = x.float()[..., :70], x.float()[..., 70:]
    torch.testing.assert_close(silu_and_mul_torch(x).float(), gate * torch.sigmoid(gate) * up, **tol)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(3, 8), torch.zeros(7))
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(torch.zeros(2, dtype=torch.long), torch.zeros(2, 8), torch.zeros(2, 8), 8, torch.zeros(4, 10))
