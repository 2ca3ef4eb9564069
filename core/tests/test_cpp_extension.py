"""pagoda.cpp_extension: a package's csrc sources compiled by the system compiler, cached by their inputs, imported as a module.

Also: a failed build is remembered with its reason; calls release the GIL; the shared headers convert 16-bit
floats as torch does; the libraries use the OpenMP runtime torch loaded."""

from __future__ import annotations

import ctypes
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagoda.cpp_extension import CppExtension, ExtensionBuildError, build, include_dir, prebuilt
from pagoda.cpp_extension.build import DEFAULT_CFLAGS

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")

EXTENSION_NAME = "pagoda_test_cpp_extension"
COMPILE_FLAGS = list(DEFAULT_CFLAGS)
_SOURCE = """
#include <pagoda/parallel.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>
#include <chrono>
#include <thread>
#include "helper.h"
PAGODA_EXPORT int64_t add_one(int64_t x) { return x + kOne; }
// Sums 0..n-1 over `threads` OpenMP threads.
PAGODA_EXPORT int64_t parallel_sum(int64_t n, int threads) {
  int64_t total = 0;
  pagoda::parallel_for(0, n, 1, threads, [&](int64_t lo, int64_t hi) {
    int64_t part = 0;
    for (int64_t i = lo; i < hi; ++i) part += i;
#pragma omp atomic
    total += part;
  });
  return total;
}
PAGODA_EXPORT uint16_t to_bf16(float f) { return pagoda::float_to_bf16(f); }
PAGODA_EXPORT uint16_t to_half(float f) { return pagoda::float_to_half(f); }
PAGODA_EXPORT float from_half(uint16_t h) { return pagoda::half_to_float(h); }
PAGODA_EXPORT void sleep_ms(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
PAGODA_EXPORT int64_t first_byte(const uint8_t* p) { return p == nullptr ? -1 : p[0]; }
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(add_one), PAGODA_FUNCTION(parallel_sum), PAGODA_FUNCTION(to_bf16),
                     PAGODA_FUNCTION(to_half), PAGODA_FUNCTION(from_half), PAGODA_FUNCTION(sleep_ms),
                     PAGODA_FUNCTION(first_byte))
"""


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(root))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    return root


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable package holding csrc/kernel.cpp and a header beside it."""
    name = f"pagoda_test_pkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / "pkgs" / name
    (root / "csrc").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "csrc" / "kernel.cpp").write_text(_SOURCE)
    (root / "csrc" / "helper.h").write_text("#pragma once\nconstexpr int kOne = 1;\n")
    monkeypatch.syspath_prepend(str(root.parent))
    yield root
    sys.modules.pop(name, None)


def _extension(package: Path) -> CppExtension:
    return CppExtension(EXTENSION_NAME, package.name, ["csrc/kernel.cpp"])


def _declare(library: ModuleType) -> ModuleType:
    assert isinstance(library, ModuleType)
    return library


def test_key_depends_on_sources_and_flags() -> None:
    key = prebuilt.build_key(EXTENSION_NAME, ["a"], [COMPILE_FLAGS])
    assert key == prebuilt.build_key(EXTENSION_NAME, ["a"], [COMPILE_FLAGS])
    assert key != prebuilt.build_key(EXTENSION_NAME, ["b"], [COMPILE_FLAGS])
    assert key != prebuilt.build_key(EXTENSION_NAME, ["a"], [[*COMPILE_FLAGS, "-DX"]])


def test_built_library_is_cached_and_loaded_again_without_compiling(
    cache_root: Path, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = _declare(_extension(package).library())
    assert library.add_one(41) == 42
    (stored,) = cache_root.glob(f"{prebuilt.CACHE_SUBDIR}/{EXTENSION_NAME}-*/lib{EXTENSION_NAME}.so")
    assert not list(stored.parent.glob(".*.tmp")), "the temporary file is renamed, not left behind"

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached library must not be compiled again")

    monkeypatch.setattr(build, "_compile", no_compiler)
    again = _extension(package)  # a fresh process's view: nothing loaded yet
    assert _declare(again.library()).add_one(1) == 2
    # A changed header beside the source is a new key: the cache does not serve the old library.
    (package / "csrc" / "helper.h").write_text("#pragma once\nconstexpr int kOne = 2;\n")
    failure = _extension(package).build_failure()
    assert failure is not None and "must not be compiled again" in failure


def test_a_second_build_of_the_same_library_waits_for_the_first_and_loads_it(
    cache_root: Path, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pagoda serve`'s API process starts the attention kernel's build and its engine-core process asks for
    the same library while it compiles: the second waits on the build lock and loads the first's library."""
    compiled: list[Path] = []
    real_compile = build._compile
    second = _extension(package)  # another process's view: its own CppExtension, nothing loaded

    def compile_and_let_another_ask(sources: list[Path], output: Path, cflags: list[str]) -> None:
        compiled.append(output)
        if len(compiled) == 1:
            second.start()
            time.sleep(0.5)  # the second build has asked by now, and found no library in the cache
        real_compile(sources, output, cflags)

    monkeypatch.setattr(build, "_compile", compile_and_let_another_ask)
    assert _declare(_extension(package).library()).add_one(1) == 2
    assert _declare(second.library()).add_one(2) == 3
    assert len(compiled) == 1, "the second build compiled the same sources again instead of waiting"
    (lock,) = cache_root.glob(f"{prebuilt.CACHE_SUBDIR}/{EXTENSION_NAME}-*/{prebuilt.LOCK_NAME}")
    assert lock.is_file()


def test_module_functions_convert_their_arguments(cache_root: Path, package: Path) -> None:
    library = _extension(package).library()
    data = torch.tensor([7, 8], dtype=torch.uint8)
    assert library.first_byte(data.data_ptr()) == 7
    assert library.first_byte(None) == -1  # None is a null pointer
    with pytest.raises(TypeError, match="expected 1 arguments"):
        library.add_one(1, 2)
    with pytest.raises(TypeError):
        library.add_one("1")


def test_calls_release_the_gil(cache_root: Path, package: Path) -> None:
    """The server's event loop runs while a kernel computes: a 300 ms call must not stop Python threads."""
    library = _extension(package).library()
    ticks = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    before = len(ticks)
    library.sleep_ms(300)
    during = len(ticks) - before
    stop.set()
    ticker.join()
    assert during >= 10, f"the ticker ran {during} times during the call"


def test_plain_c_build_loads_with_ctypes(package: Path, tmp_path: Path) -> None:
    """compile_to builds the C entry points without a module (tests build other CPUs' variants so)."""
    library = ctypes.CDLL(str(_extension(package).compile_to(tmp_path / "libplain.so", ["-O1"])))
    library.add_one.argtypes, library.add_one.restype = [ctypes.c_int64], ctypes.c_int64
    assert library.add_one(5) == 6
    assert not hasattr(library, f"PyInit_{EXTENSION_NAME}")


def test_broken_library_is_ignored_and_removed(cache_root: Path) -> None:
    path = prebuilt._library_path(EXTENSION_NAME, "bad")
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")
    assert prebuilt.load_prebuilt(EXTENSION_NAME, "bad") is None
    assert not path.exists()


def test_disabled_cache_stores_nothing(cache_root: Path, package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_CACHE", "1")
    assert _declare(_extension(package).library()).add_one(2) == 3
    assert not cache_root.exists()


def test_failed_build_is_remembered_with_its_reason(
    cache_root: Path, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (package / "csrc" / "kernel.cpp").write_text("int broken( {\n")
    calls = []
    real_compile = build._compile

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(build, "_compile", counting)
    extension = _extension(package)
    failure = extension.build_failure()
    assert failure is not None and "could not be compiled" in failure and "kernel.cpp" in failure
    with pytest.raises(ExtensionBuildError, match="could not be compiled"):
        extension.library()
    assert len(calls) == 1  # not rebuilt on every call


def test_missing_compiler_is_a_reason(cache_root: Path, package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    build.compiler_path.cache_clear()
    try:
        failure = _extension(package).build_failure()
    finally:
        build.compiler_path.cache_clear()
    assert failure is not None and "no C++ compiler found" in failure


def test_background_build_is_waited_for(cache_root: Path, package: Path) -> None:
    extension = _extension(package)
    extension.start()
    extension.start()  # a second start while building (or built) starts nothing more
    assert _declare(extension.library()).parallel_sum(1000, 2) == 999 * 1000 // 2


def test_kernels_use_the_openmp_runtime_torch_loaded(cache_root: Path, package: Path) -> None:
    """Loading the kernels maps no OpenMP runtime of their own: their threads are torch's pool.

    Compared before and after loading, since other libraries a test session imports (scikit-learn
    through sentence-transformers) may have mapped their own libgomp already.
    """

    def mapped_runtimes() -> set[str]:
        with open("/proc/self/maps") as f:
            return {Path(line.split()[-1]).resolve().as_posix() for line in f if "libgomp" in line.split()[-1]}

    torch.ones(1000).sum()  # torch is loaded with its runtime
    before = mapped_runtimes()
    library = _declare(_extension(package).library())
    assert library.parallel_sum(10_000, 2) == 9_999 * 10_000 // 2
    assert mapped_runtimes() == before
    shipped = build.openmp_link_flags()
    if shipped:  # torch ships its own: that one is what the kernels link, and it is mapped
        assert Path(shipped[0]).resolve().as_posix() in before


def test_shared_header_converts_16_bit_floats_as_torch_does(cache_root: Path, package: Path) -> None:
    library = _declare(_extension(package).library())
    generator = torch.Generator().manual_seed(0)
    values = torch.cat(
        [torch.randn(2000, generator=generator) * scale for scale in (1e-8, 1e-6, 1e-4, 1.0, 1e2, 1e4, 7e4)]
        + [torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.0, 65520.0, 6e-8, 3e-8, 2.98e-8])]
    )
    as_bits = lambda t: [v & 0xFFFF for v in t.view(torch.int16).tolist()]  # noqa: E731
    assert [library.to_bf16(v) for v in values.tolist()] == as_bits(values.bfloat16())
    assert [library.to_half(v) for v in values.tolist()] == as_bits(values.half())
    assert library.to_bf16(float("nan")) == 0x7FC0
    every_half = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float().tolist()
    for bits, expected in enumerate(every_half):
        got = library.from_half(bits)
        assert got == expected or (got != got and expected != expected), bits


def test_headers_ship_with_the_package() -> None:
    assert (include_dir() / "pagoda" / "simd.h").is_file()
    assert (include_dir() / "pagoda" / "parallel.h").is_file()
