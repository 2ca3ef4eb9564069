"""GPU configuration rules that need no device: KV budget arithmetic and CUDA graph sizes.

Kept apart from the platform class so they can be tested on any machine.
The platform hands the results to the engine's config resolution as typed
defaults (``pagoda.platforms.PlatformDefaults``).
"""

from __future__ import annotations

DEFAULT_MAX_CAPTURE_SIZE = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
GiB = 1 << 30


def kv_budget_from_memory(total: int, free: int, utilization: float, activation_bytes: int) -> int:
    """Bytes left for the KV cache once weights (already loaded) and activations are paid for.

    The engine may use ``utilization * total``; what is in use now (this process's
    weights and anything other processes hold) and the activation peak come off it.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    used = total - free
    budget = int(total * utilization) - used - activation_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {total * utilization / GiB:.2f} GiB of "
            f"{total / GiB:.2f} GiB, but {used / GiB:.2f} GiB is already in use (weights, other processes) "
            f"and activations need {activation_bytes / GiB:.2f} GiB: no room is left for the KV cache. "
            "Raise gpu_memory_utilization, free the GPU, or set kv_cache_memory_bytes."
        )
    return budget


def default_capture_sizes(max_num_seqs: int, max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, then every 8 up to min(max_num_seqs, max_capture_size)."""
    limit = min(max_num_seqs, max_capture_size)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)  # the largest batch must have a graph to pad into
    return sizes
