"""One lazily compiled C++ extension: sources, flags, and the memory of a failed build."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType

from pagoda.cpp_extension import prebuilt

logger = logging.getLogger(__name__)

# -ffp-contract=fast: fuse the vector multiply-adds into FMAs (off by default under -std=c++NN).
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
DEFAULT_LDFLAGS = ("-fopenmp",)


class ExtensionBuildError(RuntimeError):
    """The extension could not be compiled or loaded here; the message says why."""


class CppExtension:
    """A C++ extension built on first use.

    ``sources`` returns the C++ texts (declarations first); it is called only when
    the library is not yet loaded, so plugins can read their ``.cpp`` files lazily.
    """

    def __init__(
        self,
        name: str,
        sources: Callable[[], list[str]],
        functions: list[str],
        cflags: tuple[str, ...] = DEFAULT_CFLAGS,
        ldflags: tuple[str, ...] = DEFAULT_LDFLAGS,
    ) -> None:
        self.name = name
        self._sources = sources
        self.functions = functions
        self.cflags = list(cflags)
        self.ldflags = list(ldflags)
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failure: str | None = None

    def module(self) -> ModuleType:
        """The compiled library; builds it on first use. Raises ExtensionBuildError when it cannot be built."""
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is not None:
                return self._module
            if self._failure is not None:
                raise ExtensionBuildError(self._failure)
            try:
                self._module = self._build()
            except Exception as exc:  # a compiler error, a missing toolchain, no OpenMP ...
                self._failure = f"the C++ kernels of {self.name} could not be compiled ({type(exc).__name__}: {_first_lines(str(exc))})"
                logger.warning("%s", self._failure)
                raise ExtensionBuildError(self._failure) from exc
            return self._module

    def build_failure(self) -> str | None:
        """Why the extension is unusable here, or None once it is built (building it if needed)."""
        try:
            self.module()
        except ExtensionBuildError as exc:
            return str(exc)
        return None

    def reset(self) -> None:
        """Forget a loaded module or a remembered failure (tests)."""
        with self._lock:
            self._module = None
            self._failure = None

    def _build(self) -> ModuleType:
        sources = self._sources()
        started = time.perf_counter()
        # A library built from exactly these inputs before: import it, skipping torch's JIT machinery.
        key = prebuilt.build_key(self.name, sources, [self.functions, self.cflags, self.ldflags])
        module = prebuilt.load_prebuilt(self.name, key)
        if module is not None:
            logger.info("%s loaded in %.2f s (prebuilt)", self.name, time.perf_counter() - started)
            return module

        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name=self.name,
            cpp_sources=sources,
            functions=self.functions,
            extra_cflags=self.cflags,
            extra_ldflags=self.ldflags,
            verbose=False,
        )
        prebuilt.store_prebuilt(module, self.name, key)
        logger.info("%s compiled in %.1f s", self.name, time.perf_counter() - started)
        return module


def _first_lines(text: str, limit: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit]) + (" ..." if len(lines) > limit else "")
