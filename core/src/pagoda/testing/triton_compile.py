"""Compile Triton kernels for GPU targets on a machine without a GPU (a test of the compiled path).

Triton's interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes, but not that Triton's
compiler accepts it: constexpr branches, casts, ``tl.dot`` operand types and shapes are only
checked when the kernel is lowered. ``compile_for_target`` lowers kernels to PTX (CUDA) or to a
HSA code object (ROCm) for a named GPU with ``triton.compile`` -- no device or driver is needed --
in a fresh interpreter without ``TRITON_INTERPRET`` (a test session that set it has its kernels
decorated as interpreted functions, which the compiler cannot take).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# name -> (backend, arch, warp size) as triton.backends.compiler.GPUTarget takes them
TARGETS: dict[str, tuple[str, int | str, int]] = {
    "cuda-sm90": ("cuda", 90, 32),
    "cuda-sm80": ("cuda", 80, 32),
    "rocm-gfx942": ("hip", "gfx942", 64),
}

_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

request = json.loads(sys.stdin.read())
target = GPUTarget(*request["target"])
results = {}
for case in request["cases"]:
    kernel = getattr(importlib.import_module(case["module"]), case["kernel"])
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=case["signature"], constexprs=case["constexprs"]),
                                  target=target)
        results[case["name"]] = "ok" if compiled.asm else "no code"
    except Exception as exc:  # reported per case
        results[case["name"]] = f"{type(exc).__name__}: {exc}"[:4000]
print(json.dumps(results))
"""


@dataclass(frozen=True)
class KernelCase:
    """One specialization of a ``@triton.jit`` kernel: its runtime arguments' types and constexpr values."""

    name: str
    module: str
    kernel: str
    signature: dict[str, str]  # argument -> "*fp32", "i32", ..., or "constexpr"
    constexprs: dict[str, Any] = field(default_factory=dict)


def compile_for_target(cases: list[KernelCase], target: str, timeout: float = 600.0) -> dict[str, str]:
    """Each case's outcome on ``target`` (a key of ``TARGETS``): "ok" or the compiler's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    request = {"target": list(TARGETS[target]), "cases": [asdict(c) for c in cases]}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(request), capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the Triton compile run failed ({done.returncode}): {done.stderr[-4000:]}")
    results: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return results
