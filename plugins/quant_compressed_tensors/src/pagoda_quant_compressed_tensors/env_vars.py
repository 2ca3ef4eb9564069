"""This plugin's environment variables; ``plugin.pagoda_add_env_vars`` declares them to core's registry.

Read them as ``pagoda.envs.<NAME>`` (parsed at each read).
"""

from __future__ import annotations

from typing import Any

from pagoda.envs import EnvVar, parse_choice

DISTRIBUTION = "pagoda-quant-compressed-tensors"

VARIABLES: list[EnvVar[Any]] = [
    EnvVar("PAGODA_INT8_KERNEL", "one of auto, 0, vnni512, avx512bw, avx2, scalar", "auto",
           "int8 compressed-tensors matmul: auto (the best path this CPU runs; Triton on CUDA/ROCm), 0 (the "
           "torch reference everywhere), or one path of the C++ library.",
           DISTRIBUTION, parse_choice("auto", "0", "vnni512", "avx512bw", "avx2", "scalar")),
]
