"""Every ``PAGODA_*`` environment variable, in one registry (vLLM's ``envs.py``).

Read one as a module attribute: ``pagoda.envs.PAGODA_CPU_THREADS`` parses the
variable *when it is read* (never cached at import), so a test's
``monkeypatch.setenv`` or a launcher's ``os.environ`` change is seen by the
next read. An unset variable, or one set to the empty string, gives its
default (``PAGODA_PLUGINS`` is the exception: empty means "no plugin"). A
value that does not parse raises ``ValueError`` naming the variable, never
falls back silently.

``REGISTRY`` holds each variable's type, default, meaning and the distribution
that reads it. Core declares its own below; a plugin declares its own with the
``pagoda_add_env_vars(registry)`` hook (as pytest plugins declare their options
with ``pytest_addoption``), which every plugin manager calls for each plugin it
registers, in whichever process loads plugins (the API process, the engine-core
process, each worker). ``all_variables()`` loads the process's plugins first, so
it lists them all: docs/environment.md lists the same, ``pagoda collect-env``
checks the set ones against it, and core/tests/test_envs.py fails when a
``PAGODA_*`` name used anywhere in the repository is missing. ``pagoda-kernels``
reads ``PAGODA_KERNELS_IMPL`` itself because it does not depend on pagoda-core;
core lists it here, with the repository's benchmark variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
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


def parse_str(name: str, raw: str) -> str:
    return raw.strip()


def parse_verbatim(name: str, raw: str) -> str:
    return raw  # secrets are compared byte for byte


def parse_path(name: str, raw: str) -> Path:
    return Path(raw.strip()).expanduser()


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no or on/off)")


def parse_positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not an integer") from exc
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def parse_positive_gib(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number of GiB") from exc
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw}")
    return value


def parse_positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw}")
    return value


def parse_names(name: str, raw: str) -> list[str]:
    return [n.strip() for n in raw.split(",") if n.strip()]


def parse_choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip()
        if value not in choices:
            raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


_CORE = "pagoda-core"

_VARIABLES: list[EnvVar[Any]] = [
    # -- core ------------------------------------------------------------------
    EnvVar("PAGODA_PLUGINS", "comma-separated names", None,
           "Plugins to load, by entry-point or distribution name; unset loads all, empty loads none.",
           _CORE, parse_names, empty_is_unset=False),
    EnvVar("PAGODA_DEVICE", "str", "auto",
           "Platform to run on (auto, cpu, cuda, rocm, tpu, ...); --device / device= win over it.",
           _CORE, parse_str),
    EnvVar("PAGODA_ATTENTION_BACKEND", "str", None,
           "Attention backend by name; unset: the platform's preference. --attention-backend wins over it.",
           _CORE, parse_str),
    EnvVar("PAGODA_API_KEY", "str", None,
           "API key the server requires as 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every path but /health, /ping, "
           "/metrics and /version, and the CLI clients send.",
           _CORE, parse_verbatim),
    EnvVar("PAGODA_ALLOW_LONG_MAX_MODEL_LEN", "bool", False,
           "Allow a max_model_len longer than the model's positions (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN); "
           "outputs past them may be meaningless.",
           _CORE, parse_bool),
    EnvVar("PAGODA_CACHE_ROOT", "path", None,
           "Root of pagoda's on-disk cache (GGUF conversions, compiled kernels); "
           "unset: $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda.",
           _CORE, parse_path),
    EnvVar("PAGODA_DISABLE_CACHE", "bool", False,
           "Turn the on-disk cache off (GGUF conversions are redone, kernels rebuilt each process).",
           _CORE, parse_bool),
    EnvVar("PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS", "int", 300,
           "Seconds the mp executor waits for its workers to finish one step before it declares them hung, "
           "fails the requests in flight and stops every worker (as VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).",
           _CORE, parse_positive_int),
    EnvVar("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", "bool", False,
           "1: the server offers /v1/load_lora_adapter and /v1/unload_lora_adapter (as "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING); for local development only: anyone who reaches the API can load files.",
           _CORE, parse_bool),
    EnvVar("PAGODA_SERVER_DEV_MODE", "bool", False,
           "1: the server offers vLLM's development endpoints /sleep, /wake_up and /is_sleeping (as "
           "VLLM_SERVER_DEV_MODE); the engine needs --enable-sleep-mode for /sleep to succeed.",
           _CORE, parse_bool),
    EnvVar("PAGODA_LORA_RESOLVER_CACHE_DIR", "path", None,
           "Directory the built-in filesystem LoRA resolver looks in: a request whose model names no loaded adapter "
           "is served <dir>/<name> when that is a PEFT LoRA adapter of the base model (as VLLM_LORA_RESOLVER_CACHE_DIR; "
           "the server asks resolvers only with PAGODA_ALLOW_RUNTIME_LORA_UPDATING).",
           _CORE, parse_path),
    EnvVar("PAGODA_ENABLE_V1_MULTIPROCESSING", "bool", False,
           "1: AsyncLLM runs the engine core in its own process (MPClient); 0: in a thread of the API "
           "process (as VLLM_ENABLE_V1_MULTIPROCESSING). Unset: `pagoda serve` uses the process for a "
           "single-rank engine (a TP/PP executor keeps the thread), an AsyncLLM made in a script the thread; "
           "data_parallel_size > 1 always uses processes.",
           _CORE, parse_bool),
    EnvVar("PAGODA_LOG_STATS_INTERVAL", "float", 10.0,
           "Seconds between the engine's periodic statistics log lines (the SpecDecoding metrics line), "
           "as VLLM_LOG_STATS_INTERVAL.",
           _CORE, parse_positive_float),
    # -- kernels ------------------------------------------------------------------
    EnvVar("PAGODA_KERNELS_IMPL", "one of auto, triton, torch", "auto",
           "pagoda-kernels' implementation when a call does not choose: auto (Triton on GPU tensors), "
           "triton (also on CPU under TRITON_INTERPRET=1), torch (the references). The gguf and "
           "compressed-tensors methods' Triton kernels follow it too.",
           "pagoda-kernels", parse_choice("auto", "triton", "torch")),
    # -- repository benchmarks (benchmarks/, not installed) -------------------------
    EnvVar("PAGODA_BENCH_VLLM_PYTHON", "command", None,
           "Python interpreter with vLLM installed, for the peer comparison (python -m benchmarks.peers).",
           "benchmarks/", parse_str),
    EnvVar("PAGODA_BENCH_LLAMACPP_PYTHON", "command", None,
           "Python interpreter with llama-cpp-python installed, for the peer comparison.",
           "benchmarks/", parse_str),
    EnvVar("PAGODA_BENCH_DIR", "path", None,
           "Where benchmarks/quant_int8_fp8kv.py writes its quantized checkpoints; unset: "
           "/tmp/pagoda-bench-int8.",
           "benchmarks/", parse_str),
]

class EnvRegistry:
    """The process's variables by name: core's, then each plugin's as it registers."""

    def __init__(self, variables: Iterable[EnvVar[Any]] = ()) -> None:
        self.variables: dict[str, EnvVar[Any]] = {}
        self.add(*variables)

    def add(self, *variables: EnvVar[Any]) -> None:
        """Declare variables; declaring the same one again is a no-op, another under a taken name an error."""
        for var in variables:
            if not var.name.startswith("PAGODA_"):
                raise ValueError(f"{var.name!r}: pagoda's environment variables are named PAGODA_*")
            known = self.variables.get(var.name)
            if known is not None and known != var:
                raise ValueError(f"{var.name} is declared twice: by {known.read_by} and by {var.read_by}")
            self.variables[var.name] = var


REGISTRY = EnvRegistry(_VARIABLES)
# The registry's live dict (plugins' variables appear once their plugin is registered).
ENVIRONMENT_VARIABLES: dict[str, EnvVar[Any]] = REGISTRY.variables

if TYPE_CHECKING:  # what ``pagoda.envs.<NAME>`` returns for core's own; a plugin's is Any
    PAGODA_PLUGINS: list[str] | None
    PAGODA_DEVICE: str
    PAGODA_ATTENTION_BACKEND: str | None
    PAGODA_API_KEY: str | None
    PAGODA_ALLOW_LONG_MAX_MODEL_LEN: bool
    PAGODA_CACHE_ROOT: Path | None
    PAGODA_DISABLE_CACHE: bool
    PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS: int
    PAGODA_ALLOW_RUNTIME_LORA_UPDATING: bool
    PAGODA_SERVER_DEV_MODE: bool
    PAGODA_LORA_RESOLVER_CACHE_DIR: Path | None
    PAGODA_ENABLE_V1_MULTIPROCESSING: bool
    PAGODA_KERNELS_IMPL: str
    PAGODA_BENCH_VLLM_PYTHON: str | None
    PAGODA_BENCH_LLAMACPP_PYTHON: str | None
    PAGODA_BENCH_DIR: str | None


def all_variables() -> Mapping[str, EnvVar[Any]]:
    """Every variable: core's and those of each plugin this process loads (loaded first, if not yet)."""
    from pagoda.plugins import get_plugin_manager

    pm = get_plugin_manager(load=False)
    # a variable read while the plugins load (a plugin module reading one at import) must not load them again
    if not pm.entry_points_loaded and not pm.loading_entry_points:
        pm.load_entry_points()
    return ENVIRONMENT_VARIABLES


def _lookup(name: str) -> EnvVar[Any] | None:
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None and name.startswith("PAGODA_"):
        # a plugin's variable read before any plugin manager registered that plugin (its code
        # imported directly, as tests do): load the process's plugins, which declares it
        var = all_variables().get(name)
    return var


def __getattr__(name: str) -> Any:
    var = _lookup(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.get()


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether variable ``name`` is set to a value (so its default is not in use)."""
    var = _lookup(name)
    if var is None:
        raise KeyError(f"{name} is not a pagoda environment variable")
    return var.is_set(environ)
