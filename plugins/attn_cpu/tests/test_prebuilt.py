"""The compiled kernel's cached copy: stored after a build, imported directly by the next process, keyed by its inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda_attn_cpu import prebuilt
from pagoda_attn_cpu.kernel import COMPILE_FLAGS, EXTENSION_NAME, KernelBuildError, kernel


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    return tmp_path


@pytest.fixture
def built():  # type: ignore[no-untyped-def]
    try:
        return kernel()
    except KernelBuildError as exc:
        pytest.skip(f"no C++ toolchain here: {exc}")


def test_key_depends_on_sources_and_flags() -> None:
    key = prebuilt.build_key(EXTENSION_NAME, ["a"], [COMPILE_FLAGS])
    assert key == prebuilt.build_key(EXTENSION_NAME, ["a"], [COMPILE_FLAGS])
    assert key != prebuilt.build_key(EXTENSION_NAME, ["b"], [COMPILE_FLAGS])
    assert key != prebuilt.build_key(EXTENSION_NAME, ["a"], [[*COMPILE_FLAGS, "-DX"]])


def test_stored_library_is_loaded_again(cache_root: Path, built) -> None:  # type: ignore[no-untyped-def]
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "k1") is None
    prebuilt.store_prebuilt(built, EXTENSION_NAME, "k1")
    stored = list(cache_root.glob(f"torch_extensions/{EXTENSION_NAME}-k1/*"))
    assert len(stored) == 1 and stored[0].stat().st_size == Path(built.__file__).stat().st_size
    module = prebuilt.load_prebuilt(EXTENSION_NAME, "k1")
    assert module is not None and hasattr(module, "paged_attention")
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "k2") is None


def test_broken_library_is_ignored_and_removed(cache_root: Path) -> None:
    path = prebuilt._library_path(EXTENSION_NAME, "bad")
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "bad") is None
    assert not path.exists()


def test_disabled_cache_stores_nothing(cache_root: Path, monkeypatch: pytest.MonkeyPatch, built) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGODA_DISABLE_CACHE", "1")
    prebuilt.store_prebuilt(built, EXTENSION_NAME, "k1")
    assert not any(cache_root.iterdir())
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "k1") is None
