"""This plugin's environment variables; ``plugin.pagoda_add_env_vars`` declares them to core's registry.

Read them as ``pagoda.envs.<NAME>`` (parsed at each read).
"""

from __future__ import annotations

from typing import Any

from pagoda.envs import EnvVar, parse_choice

DISTRIBUTION = "pagoda-quant-gptq-awq"

VARIABLES: list[EnvVar[Any]] = [
    EnvVar("PAGODA_INT4_KERNEL", "one of auto, 0, avx512, avx2, scalar", "auto",
           "GPTQ / AWQ 4-bit matmul on CPU: auto (the best path this CPU runs), 0 (the torch reference), "
           "or one path of the C++ library.",
           DISTRIBUTION, parse_choice("auto", "0", "avx512", "avx2", "scalar")),
    EnvVar("PAGODA_GPTQ8_KERNEL", "one of auto, 0, vnni512_int16, avx512, avx2, scalar, vnni512", "auto",
           "GPTQ 8-bit matmul on CPU: auto (the best path this CPU runs), 0 (the torch reference), or one path "
           "of the C++ library (vnni512_int16: activations as int16 per 32 inputs, what auto picks with "
           "AVX512-VNNI; vnni512: as int8, faster still but off by about 0.5%, never picked by auto).",
           DISTRIBUTION, parse_choice("auto", "0", "vnni512_int16", "avx512", "avx2", "scalar", "vnni512")),
]
