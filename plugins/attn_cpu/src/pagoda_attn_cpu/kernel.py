"""The C++ kernel, built once per machine (``pagoda.cpp_extension`` caches the library)."""

from __future__ import annotations

from importlib import resources
from types import ModuleType

from pagoda.cpp_extension import CppExtension

EXTENSION_NAME = "pagoda_attn_cpu_kernel"
_DECLARATIONS = """
#include <torch/extension.h>
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                              torch::Tensor slot_mapping, torch::Tensor query_start, torch::Tensor seq_lens,
                              torch::Tensor block_tables, torch::Tensor seq_ids, double scale, int64_t window,
                              double soft_cap, int64_t tile_tokens);
"""



def _sources() -> list[str]:
    return [_DECLARATIONS, resources.files("pagoda_attn_cpu").joinpath("paged_attention.cpp").read_text()]


EXTENSION = CppExtension(EXTENSION_NAME, _sources, ["paged_attention"])


def kernel() -> ModuleType:
    """The compiled extension; builds it on first use. Raises ExtensionBuildError when it cannot be built."""
    return EXTENSION.module()


def build_failure() -> str | None:
    """Why the kernel is unusable here, or None once it is built (building it if needed)."""
    return EXTENSION.build_failure()
