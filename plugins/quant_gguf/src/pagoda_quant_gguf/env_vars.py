"""This plugin's environment variables; ``plugin.pagoda_add_env_vars`` declares them to core's registry.

Read them as ``pagoda.envs.<NAME>`` (parsed at each read).
"""

from __future__ import annotations

from typing import Any

from pagoda.envs import EnvVar, parse_bool

DISTRIBUTION = "pagoda-quant-gguf"

VARIABLES: list[EnvVar[Any]] = [
    EnvVar("PAGODA_GGUF_KERNEL", "bool", True,
           "Off: GGUF layers kept in blocks run the plain-torch dequantize reference instead of the C++ "
           "block kernel (CPU) or the Triton one (CUDA/ROCm) (A/B checks).",
           DISTRIBUTION, parse_bool),
]
