"""A kernel library that an environment variable can turn off or force onto one of its paths.

The quantization plugins' CPU kernels (int8, int4) are each one library with several code paths
(VNNI, AVX-512, AVX2, portable) chosen at run time from the CPU's flags. Their variable reads
``0`` (run the torch reference instead), ``auto`` (the library picks) or a path's name (forced, for
A/B measurements and for testing a path this CPU would not pick). The library reports what it
can run through one exported function: bit ``c`` set for each runnable path code ``c``, and the
code ``auto`` picks in bits 8-15.
"""

from __future__ import annotations

from types import ModuleType

from pagoda import envs
from pagoda.cpp_extension.build import CppExtension, ExtensionBuildError


class SwitchedKernelLibrary:
    """``extension``'s library behind the environment variable ``variable`` (a ``pagoda.envs`` name, re-read
    at every call)."""

    def __init__(self, extension: CppExtension, variable: str, paths: dict[str, int], paths_function: str) -> None:
        self.extension = extension
        self.variable = variable
        # path name -> code; "auto" is 0
        self.codes = dict(paths)
        self.paths_function = paths_function
        self._library: ModuleType | None = None
        self._auto_path: str | None = None  # what auto picks on this CPU, asked of the library once

    def setting(self) -> str:
        """The variable's value: ``0``, ``auto`` or a path's name (``pagoda.envs`` refuses anything else)."""
        value: str = getattr(envs, self.variable)
        return value

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

    def path_name(self) -> str:
        """The path the library runs now: the forced one, or the one ``auto`` picks on this CPU."""
        forced = self.setting()
        if forced != "auto":
            return forced
        if self._auto_path is None:
            self._auto_path = self.paths()[0]
        return self._auto_path

    def describe(self, what: str) -> str:
        """What runs ``what``'s layers (e.g. "int8"): the C++ kernel and its path, or the torch reference and why."""
        if self.library() is None:
            why = "off" if self.setting() == "0" else self.build_failure()
            return f"torch reference (no {what} library: {why})"
        return f"{what} C++ kernel, path {self.path_name()}"

    def check(self, ran: int) -> None:
        """A kernel call's result: negative where the forced path does not run on this CPU, a clear error then."""
        if ran < 0:
            raise RuntimeError(f"{self.variable}={self.setting()}: that path does not run on this CPU "
                               f"(it runs: {', '.join(self.paths())})")
