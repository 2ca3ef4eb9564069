"""Builds the C++ kernel once per process (torch caches the binary per machine in ~/.cache/torch_extensions)."""

from __future__ import annotations

import logging
import threading
import time
from importlib import resources
from types import ModuleType

from pagoda_attn_cpu import prebuilt

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pagoda_attn_cpu_kernel"
# -ffp-contract=fast: fuse the vector multiply-adds into FMAs (off by default under -std=c++NN).
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_DECLARATIONS = """
#include <torch/extension.h>
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                              torch::Tensor slot_mapping, torch::Tensor query_start, torch::Tensor seq_lens,
                              torch::Tensor block_tables, torch::Tensor seq_ids, double scale, int64_t window,
                              double soft_cap, int64_t tile_tokens);
"""


class KernelBuildError(RuntimeError):
    pass


_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def kernel() -> ModuleType:
    """The compiled extension; builds it on first use. Raises KernelBuildError when it cannot be built."""
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise KernelBuildError(_failure)
        try:
            _module = _build()
        except Exception as exc:  # a compiler error, a missing toolchain, no OpenMP ...
            _failure = f"the C++ kernel could not be compiled ({type(exc).__name__}: {_first_lines(str(exc))})"
            logger.warning("cpu_paged attention unavailable: %s", _failure)
            raise KernelBuildError(_failure) from exc
        return _module


def build_failure() -> str | None:
    """Why the kernel is unusable here, or None once it is built (building it if needed)."""
    try:
        kernel()
    except KernelBuildError as exc:
        return str(exc)
    return None


def _build() -> ModuleType:
    source = resources.files("pagoda_attn_cpu").joinpath("paged_attention.cpp").read_text()
    sources, functions, ldflags = [_DECLARATIONS, source], ["paged_attention"], ["-fopenmp"]
    started = time.perf_counter()
    # A library built from exactly these inputs before: import it, skipping torch's JIT machinery.
    key = prebuilt.build_key(EXTENSION_NAME, sources, [functions, COMPILE_FLAGS, ldflags])
    module = prebuilt.load_prebuilt(EXTENSION_NAME, key)
    if module is not None:
        logger.info("cpu_paged attention kernel loaded in %.2f s (prebuilt)", time.perf_counter() - started)
        return module

    from torch.utils.cpp_extension import load_inline

    module = load_inline(
        name=EXTENSION_NAME,
        cpp_sources=sources,
        functions=functions,
        extra_cflags=COMPILE_FLAGS,
        extra_ldflags=ldflags,
        verbose=False,
    )
    prebuilt.store_prebuilt(module, EXTENSION_NAME, key)
    logger.info("cpu_paged attention kernel ready in %.1f s", time.perf_counter() - started)
    return module


def _first_lines(text: str, limit: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit]) + (" ..." if len(lines) > limit else "")
