"""The CPU platform's environment variables; ``plugin.pagoda_add_env_vars`` declares them to core's registry.

Read them as ``pagoda.envs.PAGODA_CPU_...`` (parsed at each read).
"""

from __future__ import annotations

from typing import Any

from pagoda.envs import EnvVar, parse_bool, parse_positive_gib, parse_positive_int

DISTRIBUTION = "pagoda-platform-cpu"

VARIABLES: list[EnvVar[Any]] = [
    EnvVar("PAGODA_CPU_THREADS", "int", None,
           "torch threads on the CPU platform; unset: the CPUs this process may run on.",
           DISTRIBUTION, parse_positive_int),
    EnvVar("PAGODA_CPU_KVCACHE_SPACE", "float (GiB)", None,
           "KV-cache budget on CPU when kv_cache_memory_bytes is not given; unset: 4 GiB "
           "(as VLLM_CPU_KVCACHE_SPACE).",
           DISTRIBUTION, parse_positive_gib),
    EnvVar("PAGODA_CPU_KVCACHE_PREFAULT", "bool", True,
           "pagoda-only. On: start-up faults the whole lazily mapped KV cache in (madvise "
           "MADV_POPULATE_WRITE, on the platform's threads), so requests never pay first-touch page "
           "faults; resident memory is the whole cache from the start, as vLLM's is. Off: pages are "
           "mapped as blocks are first written (faster start, slower first pass over the cache).",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_PACKED_LINEAR", "bool", True,
           "Off: linear layers keep plain F.linear with unpacked weights (for A/B measurements).",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_GEMV", "bool", True,
           "Off: decode-sized linears go to oneDNN's packed matmul instead of pagoda's C++ GEMV.",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_GEMM", "bool", True,
           "Off: linears run on the GEMV + oneDNN instead of pagoda's packed AVX-512 matmul.",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_GEMM_TUNE", "bool", True,
           "Off: no start-up measurement of the packed matmul (8-row tiles, no rows handed to F.linear, "
           "a 512-token step budget); on, it runs once per CPU and dtype, on one thread, and is cached.",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_LAYER_OPS", "bool", True,
           "Off: RMSNorm, SiLU-and-mul and RoPE use torch ops instead of the fused C++ kernels.",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_SHM_ALLREDUCE", "bool", True,
           "Off: the CPU platform's all-reduce / all-gather among ranks of one host go over gloo (loopback TCP) "
           "instead of a shared-memory segment (pagoda only; vLLM has no such switch).",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_CPU_KERNEL_GRAPHS", "bool", True,
           "Off: pure-decode steps on CPU run the model eagerly instead of replaying a captured kernel graph "
           "(pagoda only; --enforce-eager turns graphs off too).",
           DISTRIBUTION, parse_bool),
]
