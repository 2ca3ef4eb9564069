"""An engine starting on the CPU platform starts compiling the attention kernel its model will use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda_attn_cpu import early_build
from pagoda_attn_cpu import kernel as kernel_module


def _config(backend: str | None = None, cache_dtype: str = "auto") -> SimpleNamespace:
    text_config = SimpleNamespace(hidden_size=576, num_attention_heads=9)  # head_dim 64, as SmolLM2-135M
    return SimpleNamespace(
        device_config=SimpleNamespace(attention_backend=backend),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        resolved_model=SimpleNamespace(text_config=text_config, dtype=torch.bfloat16),
    )


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    calls: list[tuple[torch.dtype, int]] = []
    monkeypatch.setattr(kernel_module, "start_build", lambda dtype, head_dim: calls.append((dtype, head_dim)))
    monkeypatch.delenv("PAGODA_ATTENTION_BACKEND", raising=False)
    return calls


def test_the_models_dtype_and_head_dim_are_built(started: list[tuple[torch.dtype, int]]) -> None:
    early_build.start_for_engine(_config())
    early_build.start_for_engine(_config(backend="cpu_paged", cache_dtype="float32"))
    assert started == [(torch.bfloat16, 64), (torch.float32, 64)]


def test_nothing_is_built_for_another_backend(started: list[tuple[torch.dtype, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    early_build.start_for_engine(_config(backend="torch_paged"))
    monkeypatch.setenv("PAGODA_ATTENTION_BACKEND", "torch_paged")
    early_build.start_for_engine(_config())
    assert started == []


def test_a_config_it_cannot_read_starts_nothing_and_raises_nothing(started: list[tuple[torch.dtype, int]]) -> None:
    config = _config()
    config.resolved_model.text_config = SimpleNamespace()  # no sizes to read a head_dim from
    early_build.start_for_engine(config)
    assert started == []


def test_the_started_build_is_the_one_the_backend_uses() -> None:
    extension = kernel_module.extension(torch.float32, 64)
    kernel_module.start_build(torch.float32, 64)
    assert extension.build_failure() is None
    assert kernel_module.kernel(torch.float32, 64).dtype == torch.float32
    assert kernel_module.extension(torch.float32, 80) is kernel_module.extension(torch.float32, 40)  # the generic library


@pytest.mark.parametrize(
    ("flags", "dtype_code"),
    [(["-mno-avx512f"], 0), (["-mno-avx512f"], 1), (["-mno-avx512f"], 2), (["-mno-avx512bf16"], 1)],
    ids=["avx2-f32", "avx2-bf16", "avx2-f16", "avx512_no_bf16-bf16"],  # without BF16 only bf16 changes
)
def test_source_builds_for_cpus_without_the_instructions(flags: list[str], dtype_code: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The 8-lane and the no-vdpbf16ps paths sit behind #if: every dtype's library must build without them."""
    import ctypes
    import shutil

    from pagoda.cpp_extension import CppExtension

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    extension = CppExtension(
        "pagoda_test_attn_variant", "pagoda_attn_cpu", ["csrc/paged_attention.cpp"],
        cflags=("-O1", "-march=native", "-fopenmp", f"-DPAGODA_ATTN_DTYPE={dtype_code}", "-DPAGODA_ATTN_HEAD_DIM=64"),
    )
    library = ctypes.CDLL(str(extension.compile_to(tmp_path / "libattn.so", flags)))
    assert library.pagoda_paged_attention is not None
