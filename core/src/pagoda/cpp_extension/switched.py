"""A kernel library that an environment variable can turn off or force onto one of its paths.

The quantization plugins' CPU kernels (int8, int4) are each one library with several code paths
(VNNI, AVX-512, AVX2, portable) chosen at run time from the CPU's flags. Their variable reads
``0`` (run the torch reference instead), ``auto`` (the library picks) or a path's name (forced, for
A/B measurements and for testing a path this CPU would not pick). The library reports what it
can run through one exported function: bit ``c`` set for each runnable path code ``c``, and the
code ``auto`` picks in bits 8-15.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from pagoda.cpp_extension.build import CppExtension, ExtensionBuildError


class SwitchedKernelLibrary:
    """``extension``'s library behind the switch ``setting()`` (re-read at every call)."""

    def __init__(self, extension: CppExtension, setting: Callable[[], str], paths: dict[str, int],
                 paths_function: str) -> None:
        self.extension = extension
        self.setting = setting
        # path name -> code; "auto" is 0
        self.codes = dict(paths)
        self.paths_function = paths_function
        self._library: ModuleType | None = None

    def library(self) -> ModuleType | None:
        """The compiled library, or None where it is off or cannot be built (``build_failure`` says why)."""
        if self.setting() == "0":
            return None
        if self._library is None:
            try:
                self._library = self.extension.library()
            except ExtensionBuildError:
                return None
        return self._library

    def build_failure(self) -> str | None:
        return self.extension.build_failure()

    def path_code(self) -> int:
        """The code of the path the setting asks for (0: the library's own choice)."""
        return self.codes[self.setting()]

    def paths(self) -> list[str]:
        """The paths this CPU runs, the one ``auto`` picks first ([] without the library)."""
        lib = self.library()
        if lib is None:
            return []
        bits = int(getattr(lib, self.paths_function)())
        names = {code: name for name, code in self.codes.items()}
        runnable = [names[c] for c in sorted(names) if c and bits & (1 << c)]
        chosen = names[(bits >> 8) & 0xFF]
        return [chosen] + [p for p in runnable if p != chosen]
