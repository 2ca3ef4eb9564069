"""GPU configuration rules that need no device: KV budget arithmetic and CUDA graph sizes.

Kept apart from the platform class so they can be tested on any machine.
The engine config has no dedicated fields for these yet; they travel in
``EngineConfig.extra`` under vLLM's names.
"""

from __future__ import annotations

from typing import Any

ENFORCE_EAGER_KEY = "enforce_eager"
CAPTURE_SIZES_KEY = "cuda_graph_sizes"
# vLLM's newer spelling: extra["compilation_config"] = {"cudagraph_capture_sizes": [...],
# "max_cudagraph_capture_size": N}; the flat key wins when both are given.
COMPILATION_CONFIG_KEY = "compilation_config"
VLLM_CAPTURE_SIZES_KEY = "cudagraph_capture_sizes"
VLLM_MAX_CAPTURE_SIZE_KEY = "max_cudagraph_capture_size"
PIN_MEMORY_KEY = "pin_memory"
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


def resolve_capture_sizes(extra: dict[str, Any], max_num_seqs: int) -> list[int]:
    """The sorted CUDA graph batch sizes; [] when ``enforce_eager`` is set."""
    if extra.get(ENFORCE_EAGER_KEY, False):
        return []
    compilation = extra.get(COMPILATION_CONFIG_KEY) or {}
    if not isinstance(compilation, dict):
        raise ValueError(f"extra[{COMPILATION_CONFIG_KEY!r}] must be a dict, got {compilation!r}")
    given = extra.get(CAPTURE_SIZES_KEY)
    if given is None:
        given = compilation.get(VLLM_CAPTURE_SIZES_KEY)
    if given is None:
        limit = compilation.get(VLLM_MAX_CAPTURE_SIZE_KEY, DEFAULT_MAX_CAPTURE_SIZE)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"{COMPILATION_CONFIG_KEY}.{VLLM_MAX_CAPTURE_SIZE_KEY} must be an int >= 0, got {limit!r}")
        return default_capture_sizes(max_num_seqs, limit) if limit else []
    if not isinstance(given, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in given):
        raise ValueError(f"extra[{CAPTURE_SIZES_KEY!r}] must be a list of ints, got {given!r}")
    bad = [s for s in given if s <= 0]
    if bad:
        raise ValueError(f"extra[{CAPTURE_SIZES_KEY!r}] holds non-positive batch sizes {bad}")
    # Graphs larger than the largest possible decode batch would never be replayed.
    return sorted({s for s in given if s <= max_num_seqs})
