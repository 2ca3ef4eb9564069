"""Build a plugin's C++ kernels once per machine and load them fast afterwards.

Plugins that ship C++ sources (the CPU attention kernel, the CPU platform's
linear and elementwise kernels) describe them as a ``CppExtension``; the first
use compiles them with torch's JIT (``load_inline``), later processes import a
cached copy of the library (``prebuilt``). A build that fails is remembered with
its reason, so a caller can report why a kernel is unavailable and fall back.
"""

from pagoda.cpp_extension.build import CppExtension, ExtensionBuildError

__all__ = ["CppExtension", "ExtensionBuildError"]
