"""Build a package's C++ kernels once per machine and load them fast afterwards.

Packages that ship C++ sources (the CPU attention kernel, the CPU platform's linear and
elementwise kernels) keep them in a ``csrc/`` folder and describe each library as a
``CppExtension``. The sources are plain C++17 with intrinsics and OpenMP (no torch headers,
which were nearly all of a build's time): the system compiler turns them into a shared library
in seconds, exporting ``extern "C"`` functions over raw pointers, sizes and strides that the
package's Python wrappers call through ctypes. Builds start in the background as soon as a
platform or backend knows it will need them, are cached per machine (``prebuilt``), and a
build that fails is remembered with its reason, so a caller can report why a kernel is
unavailable and fall back. Every build gets ``-I`` to ``include/`` (``pagoda/simd.h``,
``pagoda/parallel.h``).
"""

from pagoda.cpp_extension.build import CppExtension, ExtensionBuildError, include_dir
from pagoda.cpp_extension.switched import SwitchedKernelLibrary

__all__ = ["CppExtension", "ExtensionBuildError", "SwitchedKernelLibrary", "include_dir"]
