"""A compiled extension's cached copy: stored after a build, imported directly by the next process, keyed by its inputs.

Also: a failed build is remembered with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.cpp_extension import CppExtension, ExtensionBuildError, prebuilt
from pagoda.cpp_extension.build import DEFAULT_CFLAGS

EXTENSION_NAME = "pagoda_test_cpp_extension"
COMPILE_FLAGS = list(DEFAULT_CFLAGS)
_SOURCE = "#include <torch/extension.h>\nint64_t add_one(int64_t x) { return x + 1; }\n"
_EXTENSION = CppExtension(EXTENSION_NAME, lambda: [_SOURCE], ["add_one"])


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    return tmp_path


@pytest.fixture
def built():  # type: ignore[no-untyped-def]
    try:
        return _EXTENSION.module()
    except ExtensionBuildError as exc:
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
    assert module is not None and module.add_one(41) == 42
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "k2") is None


def test_broken_library_is_ignored_and_removed(cache_root: Path) -> None:
    path = prebuilt._library_path(EXTENSION_NAME, "bad")
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "bad") is None
    assert not path.exists()


def test_disabled_cache_stores_nothing(cache_root: Path, monkeypatch: pytest.MonkeyPatch, built) -> None:  # type: ignore[no-untyped-def]
    # `built` may have just compiled (and cached) the module under cache_root: compare, not expect empty
    before = sorted(cache_root.rglob("*"))
    monkeypatch.setenv("PAGODA_DISABLE_CACHE", "1")
    prebuilt.store_prebuilt(built, EXTENSION_NAME, "k1")
    assert sorted(cache_root.rglob("*")) == before
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "k1") is None


def test_failed_build_is_remembered_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken() -> list[str]:
        calls.append(1)
        raise RuntimeError("g++: command not found")

    extension = CppExtension("pagoda_test_broken", broken, ["f"])
    failure = extension.build_failure()
    assert failure is not None and "could not be compiled" in failure and "g++: command not found" in failure
    with pytest.raises(ExtensionBuildError, match="g\\+\\+: command not found"):
        extension.module()
    assert len(calls) == 1  # not rebuilt on every call
