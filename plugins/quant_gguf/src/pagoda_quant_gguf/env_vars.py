"""This plugin's environment variables; ``plugin.pagoda_add_env_vars`` declares them to core's registry.

Read them as ``pagoda.envs.<NAME>`` (parsed at each read).
"""

from __future__ import annotations

from typing import Any

from pagoda.envs import EnvVar, parse_bool, parse_positive_int

DISTRIBUTION = "pagoda-quant-gguf"


def parse_min_rows(name: str, raw: str) -> int:
    """``off`` (or 0): 0, the block kernels at every row count; else a positive row count."""
    return 0 if raw.strip().lower() in ("off", "0") else parse_positive_int(name, raw)

VARIABLES: list[EnvVar[Any]] = [
    EnvVar("PAGODA_GGUF_KERNEL", "bool", True,
           "Off: GGUF layers kept in blocks run the plain-torch dequantize reference instead of the C++ "
           "block kernel (CPU) or the Triton one (CUDA/ROCm) (A/B checks).",
           DISTRIBUTION, parse_bool),
    EnvVar("PAGODA_GGUF_DENSE_MIN_ROWS", "int or off", None,
           "Row count from which CPU GGUF layers kept in blocks dequantize weight panels and run F.linear "
           "instead of the block kernel; unset: measured once per CPU (pagoda_quant_gguf.dense); off: never.",
           DISTRIBUTION, parse_min_rows),
]
