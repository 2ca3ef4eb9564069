"""One C++ kernel library: its sources, its build in the background, and the memory of a failed build."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import ModuleType

from pagoda.cpp_extension import prebuilt

logger = logging.getLogger(__name__)

# -ffp-contract=fast: fuse the vector multiply-adds into FMAs (off by default under -std=c++NN).
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
BASE_CFLAGS = ("-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
COMPILER_ENV = "CXX"
# Longer than any kernel library takes (seconds) on a slow machine; a hung compiler is a failed build.
COMPILE_TIMEOUT_S = 600


class ExtensionBuildError(RuntimeError):
    """The library could not be compiled or loaded here; the message says why."""


def include_dir() -> Path:
    """The folder every build gets ``-I`` to: ``pagoda/simd.h``, ``pagoda/parallel.h``, ``pagoda/python.h``."""
    return Path(__file__).resolve().parent / "include"


class CppExtension:
    """A shared library compiled from a package's C++ sources, imported as a Python extension module.

    ``sources`` are paths inside ``package`` (by convention ``csrc/<name>.cpp``). The library
    exports plain ``extern "C"`` functions over pointers, sizes and strides, and lists them
    with ``PAGODA_PYTHON_MODULE`` (``pagoda/python.h``): the module's functions take Python
    ints (a tensor's ``data_ptr()``) and floats and release the GIL for the call. The
    package's Python wrappers check arguments and allocate outputs. The same file loads with
    ctypes too (its C entry points are exported).

    ``start()`` begins the build on a background thread (a compile is a subprocess, so several
    libraries build at once while the caller goes on, e.g. loading weights); ``library()``
    waits for it, or builds on the calling thread when nothing started it.
    """

    def __init__(
        self,
        name: str,
        package: str,
        sources: Sequence[str],
        cflags: Sequence[str] = DEFAULT_CFLAGS,
    ) -> None:
        self.name = name
        self.package = package
        self.sources = tuple(sources)
        self.cflags = tuple(cflags)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._library: ModuleType | None = None
        self._failure: str | None = None

    def start(self) -> None:
        """Begin building in the background, unless the library is loaded, failed or already building."""
        with self._lock:
            if self._library is not None or self._failure is not None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=f"build-{self.name}", daemon=True)
            self._thread.start()

    def library(self) -> ModuleType:
        """The loaded library; builds it (or waits for the build) first. Raises ExtensionBuildError when it cannot be built."""
        library = self._library
        if library is not None:
            return library
        self.start()
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if self._library is not None:
                return self._library
            raise ExtensionBuildError(self._failure or f"{self.name} was reset while it was building")

    def build_failure(self) -> str | None:
        """Why the library is unusable here, or None once it is loaded (building it if needed)."""
        try:
            self.library()
        except ExtensionBuildError as exc:
            return str(exc)
        return None

    def reset(self) -> None:
        """Forget a loaded library or a remembered failure (tests); a build under way finishes first."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            self._thread = None
            self._library = None
            self._failure = None

    def compile_to(self, output: Path, extra_cflags: Sequence[str] = ()) -> Path:
        """Compile the library to ``output`` with extra flags, outside the cache, as a plain C library (no module).

        Tests build the paths other CPUs take so and call them through ctypes."""
        _compile(self._source_paths(), output, [*self.cflags, *extra_cflags])
        return output

    # -- the build ------------------------------------------------------------------------------

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            library, how = self._build()
        except Exception as exc:  # a compiler error, a missing toolchain, no OpenMP, a library that does not load ...
            failure = f"the C++ kernels of {self.name} could not be compiled ({type(exc).__name__}: {_first_lines(str(exc))})"
            logger.warning("%s", failure)
            with self._lock:
                self._failure = failure
            return
        logger.info("%s %s in %.2f s", self.name, how, time.perf_counter() - started)
        with self._lock:
            self._library = library

    def _source_paths(self) -> list[Path]:
        root = resources.files(self.package)
        paths = [Path(str(root.joinpath(source))) for source in self.sources]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"C++ sources of {self.name} not found: {', '.join(missing)}")
        return paths

    def _build(self) -> tuple[ModuleType, str]:
        sources = self._source_paths()
        compiler = compiler_path()
        openmp = openmp_link_flags()
        if not (Path(python_include_dir()) / "Python.h").is_file():
            raise ExtensionBuildError(
                f"Python.h is not in {python_include_dir()}: install this Python's development headers (e.g. python3-dev)"
            )
        cflags = [*self.cflags, f"-DPAGODA_MODULE_NAME={self.name}", f"-I{python_include_dir()}"]
        key = prebuilt.build_key(
            self.name,
            _key_texts(sources),
            [cflags, list(openmp), [compiler, *compiler_version(compiler)], [sys.implementation.cache_tag]],
        )
        library = prebuilt.load_prebuilt(self.name, key)
        if library is not None:
            return library, "loaded (cached)"
        target = prebuilt.library_path(self.name, key)
        if target is None:  # cache disabled: build in a scratch folder, load, let the folder go
            with tempfile.TemporaryDirectory(prefix=f"{self.name}-") as scratch:
                built = Path(scratch) / f"lib{self.name}.so"
                _compile(sources, built, cflags)
                return prebuilt.load_library(self.name, built), "compiled (not cached)"
        target.parent.mkdir(parents=True, exist_ok=True)
        with prebuilt.build_lock(target.parent) as waited:
            # Another process (the API server's early build beside its engine core's, or a second
            # server) may have compiled this key while we waited: load its library, do not compile again.
            library = prebuilt.load_prebuilt(self.name, key)
            if library is not None:
                return library, f"loaded (built by another process; waited {waited:.2f} s)"
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".lib{self.name}.", suffix=".so.tmp")
            os.close(fd)
            try:
                _compile(sources, Path(tmp), cflags)
                published = prebuilt.publish(Path(tmp), self.name, key)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        if published is None:
            raise ExtensionBuildError(f"the built library could not be moved to {target}")
        return prebuilt.load_library(self.name, published), "compiled"


def _compile(sources: Sequence[Path], output: Path, cflags: Sequence[str]) -> None:
    compiler = compiler_path()
    cmd = [compiler, *BASE_CFLAGS, *cflags, f"-I{include_dir()}", *map(str, sources), "-o", str(output), *openmp_link_flags()]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ExtensionBuildError(f"{compiler} ran past {COMPILE_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        raise ExtensionBuildError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")


def _key_texts(sources: Sequence[Path]) -> list[str]:
    """The texts a build reads: the sources, the headers beside them, and the shared headers."""
    headers: set[Path] = set(include_dir().rglob("*.h"))
    for source in sources:
        headers.update(p for p in source.parent.iterdir() if p.suffix in (".h", ".hpp"))
    texts = [f"{p.name}\n{p.read_text()}" for p in sources]
    texts += [f"{p.name}\n{p.read_text()}" for p in sorted(headers)]
    return texts


def python_include_dir() -> str:
    """Where this interpreter's Python.h is (pagoda/python.h includes it)."""
    return sysconfig.get_paths()["include"]


@lru_cache(maxsize=1)
def compiler_path() -> str:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    configured = os.environ.get(COMPILER_ENV)
    found = shutil.which(configured) if configured else (shutil.which("c++") or shutil.which("g++"))
    if found is None:
        raise ExtensionBuildError(f"no C++ compiler found ({COMPILER_ENV}={configured!r})" if configured else "no C++ compiler found (c++, g++; or set CXX)")
    return found


@lru_cache(maxsize=4)
def compiler_version(compiler: str) -> tuple[str, ...]:
    """What the compiler says it is (part of the cache key: another compiler builds other code)."""
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
    return (os.path.realpath(compiler), result.stdout.strip().splitlines()[0] if result.stdout.strip() else "")


@lru_cache(maxsize=1)
def openmp_link_flags() -> tuple[str, ...]:
    """Link the OpenMP runtime torch ships (torch/lib/libgomp*.so*) when there is one.

    One runtime in the process means one thread pool: the kernels' parallel regions reuse
    torch's OpenMP threads instead of a second pool spinning beside them. The library names it
    (``-Wl,-rpath``), and since torch has loaded it by the time a kernel library loads, the
    dynamic loader maps no second copy. Without it, ``-fopenmp`` links the compiler's own runtime.
    """
    torch_lib = _torch_lib_dir()
    if torch_lib is None:
        return ()
    runtimes = sorted(p for p in torch_lib.glob("libgomp*.so*") if p.is_file())
    if not runtimes:
        return ()
    return (str(runtimes[0]), f"-Wl,-rpath,{torch_lib}")


def _torch_lib_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib"
    return lib if lib.is_dir() else None


def _first_lines(text: str, limit: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit]) + (" ..." if len(lines) > limit else "")
