"""Every ``PAGODA_*`` environment variable, in one place (vLLM's ``envs.py``).

Read one as a module attribute: ``pagoda.envs.PAGODA_CPU_THREADS`` parses the
variable *when it is read* (never cached at import), so a test's
``monkeypatch.setenv`` or a launcher's ``os.environ`` change is seen by the
next read. An unset variable, or one set to the empty string, gives its
default (``PAGODA_PLUGINS`` is the exception: empty means "no plugin"). A
value that does not parse raises ``ValueError`` naming the variable, never
falls back silently.

``ENVIRONMENT_VARIABLES`` holds each variable's type, default, meaning and the
distribution that reads it; docs/environment.md lists the same, and
core/tests/test_envs.py fails when a ``PAGODA_*`` name used anywhere in the
repository is missing here. Plugins add their variables here too (core lists
them as vLLM's envs.py lists its CPU and ROCm ones) and read them through this
module; ``pagoda-kernels`` reads ``PAGODA_KERNELS_IMPL`` itself because it does
not depend on pagoda-core.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: how its text becomes a value, and what it means."""

    name: str
    type: str  # as the docs show it
    default: T
    help: str
    read_by: str  # the distribution (or repository folder) that reads it
    parse: Callable[[str, str], T]  # (name, raw text) -> value; raises ValueError
    empty_is_unset: bool = True

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The current value from ``environ`` (default: ``os.environ``)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or (self.empty_is_unset and not raw.strip()):
            return self.default
        return self.parse(self.name, raw)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        raw = (os.environ if environ is None else environ).get(self.name)
        return raw is not None and (not self.empty_is_unset or bool(raw.strip()))


def _str(name: str, raw: str) -> str:
    return raw.strip()


def _verbatim(name: str, raw: str) -> str:
    return raw  # secrets are compared byte for byte


def _path(name: str, raw: str) -> Path:
    return Path(raw.strip()).expanduser()


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no or on/off)")


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not an integer") from exc
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _positive_gib(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number of GiB") from exc
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw}")
    return value


def _names(name: str, raw: str) -> list[str]:
    return [n.strip() for n in raw.split(",") if n.strip()]


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip()
        if value not in choices:
            raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


_CORE = "pagoda-core"
_CPU = "pagoda-platform-cpu"

_VARIABLES: list[EnvVar[Any]] = [
    # -- core ------------------------------------------------------------------
    EnvVar("PAGODA_PLUGINS", "comma-separated names", None,
           "Plugins to load, by entry-point or distribution name; unset loads all, empty loads none.",
           _CORE, _names, empty_is_unset=False),
    EnvVar("PAGODA_DEVICE", "str", "auto",
           "Platform to run on (auto, cpu, cuda, rocm, tpu, ...); --device / device= win over it.",
           _CORE, _str),
    EnvVar("PAGODA_ATTENTION_BACKEND", "str", None,
           "Attention backend by name; unset: the platform's preference. --attention-backend wins over it.",
           _CORE, _str),
    EnvVar("PAGODA_API_KEY", "str", None,
           "API key the server requires as 'Authorization: Bearer KEY' on /v1/*, and the CLI clients send.",
           _CORE, _verbatim),
    EnvVar("PAGODA_CACHE_ROOT", "path", None,
           "Root of pagoda's on-disk cache (GGUF conversions, compiled kernels); "
           "unset: $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda.",
           _CORE, _path),
    EnvVar("PAGODA_DISABLE_CACHE", "bool", False,
           "Turn the on-disk cache off (GGUF conversions are redone, kernels rebuilt each process).",
           _CORE, _bool),
    EnvVar("PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS", "int", 300,
           "Seconds the mp executor waits for its workers to finish one step before it declares them hung, "
           "fails the requests in flight and stops every worker (as VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).",
           _CORE, _positive_int),
    EnvVar("PAGODA_ENABLE_V1_MULTIPROCESSING", "bool", False,
           "1: AsyncLLM runs the engine core in its own process (MPClient); 0: in a thread of the API "
           "process (as VLLM_ENABLE_V1_MULTIPROCESSING). Unset: `pagoda serve` uses the process for a "
           "single-rank engine (a TP/PP executor keeps the thread), an AsyncLLM made in a script the thread; "
           "data_parallel_size > 1 always uses processes.",
           _CORE, _bool),
    # -- CPU platform -------------------------------------------------------------
    EnvVar("PAGODA_CPU_THREADS", "int", None,
           "torch threads on the CPU platform; unset: the CPUs this process may run on.",
           _CPU, _positive_int),
    EnvVar("PAGODA_CPU_KVCACHE_SPACE", "float (GiB)", None,
           "KV-cache budget on CPU when kv_cache_memory_bytes is not given; unset: 4 GiB "
           "(as VLLM_CPU_KVCACHE_SPACE).",
           _CPU, _positive_gib),
    EnvVar("PAGODA_CPU_KVCACHE_PREFAULT", "bool", True,
           "pagoda-only. On: start-up faults the whole lazily mapped KV cache in (madvise "
           "MADV_POPULATE_WRITE, on the platform's threads), so requests never pay first-touch page "
           "faults; resident memory is the whole cache from the start, as vLLM's is. Off: pages are "
           "mapped as blocks are first written (faster start, slower first pass over the cache).",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_PACKED_LINEAR", "bool", True,
           "Off: linear layers keep plain F.linear with unpacked weights (for A/B measurements).",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_GEMV", "bool", True,
           "Off: decode-sized linears go to oneDNN's packed matmul instead of pagoda's C++ GEMV.",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_GEMM", "bool", True,
           "Off: linears run on the GEMV + oneDNN instead of pagoda's packed AVX-512 matmul.",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_GEMM_TUNE", "bool", True,
           "Off: no start-up measurement of the packed matmul (8-row tiles, no rows handed to F.linear, "
           "a 512-token step budget); on, it runs once per CPU and dtype, on one thread, and is cached.",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_LAYER_OPS", "bool", True,
           "Off: RMSNorm, SiLU-and-mul and RoPE use torch ops instead of the fused C++ kernels.",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_SHM_ALLREDUCE", "bool", True,
           "Off: the CPU platform's all-reduce / all-gather among ranks of one host go over gloo (loopback TCP) "
           "instead of a shared-memory segment (pagoda only; vLLM has no such switch).",
           _CPU, _bool),
    EnvVar("PAGODA_CPU_KERNEL_GRAPHS", "bool", True,
           "Off: pure-decode steps on CPU run the model eagerly instead of replaying a captured kernel graph "
           "(pagoda only; --enforce-eager turns graphs off too).",
           _CPU, _bool),
    # -- quantization plugins -------------------------------------------------------
    EnvVar("PAGODA_GGUF_KERNEL", "bool", True,
           "Off: GGUF layers kept in blocks run the plain-torch dequantize reference instead of the C++ "
           "block kernel (CPU) or the Triton one (CUDA/ROCm) (A/B checks).",
           "pagoda-quant-gguf", _bool),
    EnvVar("PAGODA_INT8_KERNEL", "one of auto, 0, vnni512, avx512bw, avx2, scalar", "auto",
           "int8 compressed-tensors matmul: auto (the best path this CPU runs; Triton on CUDA/ROCm), 0 (the "
           "torch reference everywhere), or one path of the C++ library.",
           "pagoda-quant-compressed-tensors", _choice("auto", "0", "vnni512", "avx512bw", "avx2", "scalar")),
    EnvVar("PAGODA_INT4_KERNEL", "one of auto, 0, avx512, avx2, scalar", "auto",
           "GPTQ / AWQ 4-bit matmul on CPU: auto (the best path this CPU runs), 0 (the torch reference), "
           "or one path of the C++ library.",
           "pagoda-quant-gptq-awq", _choice("auto", "0", "avx512", "avx2", "scalar")),
    EnvVar("PAGODA_GPTQ8_KERNEL", "one of auto, 0, vnni512_int16, avx512, avx2, scalar, vnni512", "auto",
           "GPTQ 8-bit matmul on CPU: auto (the best path this CPU runs), 0 (the torch reference), or one path "
           "of the C++ library (vnni512_int16: activations as int16 per 32 inputs, what auto picks with "
           "AVX512-VNNI; vnni512: as int8, faster still but off by about 0.5%, never picked by auto).",
           "pagoda-quant-gptq-awq", _choice("auto", "0", "vnni512_int16", "avx512", "avx2", "scalar", "vnni512")),
    # -- kernels ------------------------------------------------------------------
    EnvVar("PAGODA_KERNELS_IMPL", "one of auto, triton, torch", "auto",
           "pagoda-kernels' implementation when a call does not choose: auto (Triton on GPU tensors), "
           "triton (also on CPU under TRITON_INTERPRET=1), torch (the references). The gguf and "
           "compressed-tensors methods' Triton kernels follow it too.",
           "pagoda-kernels", _choice("auto", "triton", "torch")),
    # -- repository benchmarks (benchmarks/, not installed) -------------------------
    EnvVar("PAGODA_BENCH_VLLM_PYTHON", "command", None,
           "Python interpreter with vLLM installed, for the peer comparison (python -m benchmarks.peers).",
           "benchmarks/", _str),
    EnvVar("PAGODA_BENCH_LLAMACPP_PYTHON", "command", None,
           "Python interpreter with llama-cpp-python installed, for the peer comparison.",
           "benchmarks/", _str),
    EnvVar("PAGODA_BENCH_DIR", "path", None,
           "Where benchmarks/quant_int8_fp8kv.py writes its quantized checkpoints; unset: "
           "/tmp/pagoda-bench-int8.",
           "benchmarks/", _str),
]

ENVIRONMENT_VARIABLES: dict[str, EnvVar[Any]] = {var.name: var for var in _VARIABLES}

if TYPE_CHECKING:  # what ``pagoda.envs.<NAME>`` returns
    PAGODA_PLUGINS: list[str] | None
    PAGODA_DEVICE: str
    PAGODA_ATTENTION_BACKEND: str | None
    PAGODA_API_KEY: str | None
    PAGODA_CACHE_ROOT: Path | None
    PAGODA_DISABLE_CACHE: bool
    PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS: int
    PAGODA_ENABLE_V1_MULTIPROCESSING: bool
    PAGODA_CPU_THREADS: int | None
    PAGODA_CPU_KVCACHE_SPACE: float | None
    PAGODA_CPU_KVCACHE_PREFAULT: bool
    PAGODA_CPU_PACKED_LINEAR: bool
    PAGODA_CPU_GEMV: bool
    PAGODA_CPU_GEMM: bool
    PAGODA_CPU_GEMM_TUNE: bool
    PAGODA_CPU_LAYER_OPS: bool
    PAGODA_CPU_SHM_ALLREDUCE: bool
    PAGODA_CPU_KERNEL_GRAPHS: bool
    PAGODA_GGUF_KERNEL: bool
    PAGODA_INT8_KERNEL: str
    PAGODA_INT4_KERNEL: str
    PAGODA_GPTQ8_KERNEL: str
    PAGODA_KERNELS_IMPL: str
    PAGODA_BENCH_VLLM_PYTHON: str | None
    PAGODA_BENCH_LLAMACPP_PYTHON: str | None
    PAGODA_BENCH_DIR: str | None


def __getattr__(name: str) -> Any:
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.get()


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether variable ``name`` is set to a value (so its default is not in use)."""
    return ENVIRONMENT_VARIABLES[name].is_set(environ)
