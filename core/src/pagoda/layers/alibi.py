"""ALiBi (attention with linear biases): the per-head slopes, shared by every model that uses it.

ALiBi adds no parameters and rotates nothing: attention adds ``slope[h] * (key_pos - query_pos)``
to head ``h``'s scaled logits (``pagoda.attention``: ``Attention(alibi_slopes=...)`` and the
backends' ``alibi_slopes`` argument). Falcon and Bloom write the bias as ``slope * key_pos``; the
two differ by a constant per query row, which the softmax removes.
"""

from __future__ import annotations

import math

import torch


def get_alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32 slopes, as transformers' ``build_alibi_tensor`` (Bloom, Falcon, MPT) computes them.

    A power-of-two head count ``n`` gets the geometric sequence ``2^(-8/n), 2^(-16/n), ...``;
    other counts take those of the next lower power of two, then every other slope of twice
    that count (the ALiBi paper's interpolation). Computed with torch's float32 ``pow`` as
    transformers does, so the slopes agree bit for bit.
    """
    if num_heads <= 0:
        raise ValueError(f"ALiBi needs a positive number of heads, got {num_heads}")
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32)
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    return slopes.to(torch.float32)
