"""Platform resolution: pick the one platform this process runs on, once.

No implicit fallback: a forced platform that cannot run is an error, and a
platform plugin that failed to load is reported instead of being replaced by
another platform.
"""

from __future__ import annotations

import logging

from pagoda import envs
from pagoda.platforms.interface import Platform, PlatformDefaults
from pagoda.plugins import PlatformSpec, PluginError, get_plugin_manager

logger = logging.getLogger(__name__)

DEVICE_ENV = "PAGODA_DEVICE"

# Install hints for platforms that are not installed at all.
KNOWN_PLATFORM_PACKAGES: dict[str, str] = {
    "cpu": "pagoda-platform-cpu",
    "cuda": "pagoda-platform-cuda",
    "rocm": "pagoda-platform-rocm",
    "tpu": "pagoda-platform-tpu",
}


class PlatformError(PluginError):
    """No platform can run, or the requested one cannot."""


_current: Platform | None = None


def requested_device(device: str | None = None) -> str:
    if device and device != "auto":
        return device
    return envs.PAGODA_DEVICE


def _load_and_probe(spec: PlatformSpec) -> tuple[type[Platform] | None, bool, str]:
    # A platform class that fails to import or whose probe raises is unavailable
    # with that reason; it never escapes as a bare exception.
    try:
        cls: type[Platform] = spec.load()
        ok, reason = cls.probe()
    except Exception as exc:
        return None, False, f"probe failed: {type(exc).__name__}: {exc}"
    return cls, ok, reason


def _probe_all() -> list[tuple[str, type[Platform] | None, bool, str]]:
    pm = get_plugin_manager()
    return [(name, *_load_and_probe(spec)) for name, spec in pm.platforms().items()]


def probe_platforms() -> list[tuple[str, bool, str]]:
    """(name, available, reason) for every installed platform, for `pagoda plugins list`."""
    return [(name, ok, reason) for name, _, ok, reason in _probe_all()]


def resolve_platform(device: str | None = None) -> Platform:
    """Return a new Platform for ``device`` ('auto', 'cpu', 'cuda', ...)."""
    pm = get_plugin_manager()
    wanted = requested_device(device)
    specs = pm.platforms()
    broken = pm.failed(kind="platform")
    if wanted != "auto":
        if wanted not in specs:
            hint = KNOWN_PLATFORM_PACKAGES.get(wanted, f"a package providing platform {wanted!r}")
            detail = "".join(f"\n  plugin {b.name} ({b.distribution}): {b.error}" for b in broken)
            raise PlatformError(
                f"device {wanted!r} was requested but no installed plugin provides platform {wanted!r}; "
                f"install {hint}. Installed platforms: {', '.join(sorted(specs)) or 'none'}{detail}"
            )
        cls, ok, reason = _load_and_probe(specs[wanted])
        if not ok or cls is None:
            raise PlatformError(
                f"platform {wanted!r} (from {specs[wanted].package}) cannot run here: {reason}"
            )
        return cls()
    if broken:
        lines = "\n".join(f"  plugin {b.name} ({b.distribution}): {b.error}" for b in broken)
        raise PlatformError(
            "a platform plugin failed to load, so the platform cannot be chosen automatically "
            "(pagoda never silently falls back to another platform):\n"
            f"{lines}\nFix or uninstall it, or choose a platform with --device / {DEVICE_ENV}."
        )
    rows = _probe_all()
    usable = [(specs[name].priority, name, cls) for name, cls, ok, _ in rows if ok and cls is not None]
    if not usable:
        if not rows:
            raise PlatformError(
                "no platform plugin is installed; install one, e.g. pagoda-platform-cpu "
                "(pip install pagoda-platform-cpu)"
            )
        reasons = "\n".join(f"  {name} ({specs[name].package}): {reason}" for name, _, _, reason in rows)
        raise PlatformError(f"no installed platform can run here:\n{reasons}")
    usable.sort(key=lambda r: -r[0])
    _, name, cls = usable[0]
    skipped = [f"{n}: {reason}" for n, _, ok, reason in rows if not ok]
    logger.info("platform %s selected%s", name, f" (unavailable: {'; '.join(skipped)})" if skipped else "")
    return cls()  # type: ignore[misc]


def current_platform(device: str | None = None) -> Platform:
    """The process's platform, resolved on first use (never at import time)."""
    global _current
    if _current is None:
        _current = resolve_platform(device)
    return _current


def set_current_platform(platform: Platform | None) -> None:
    global _current
    _current = platform


__all__ = [
    "DEVICE_ENV",
    "Platform",
    "PlatformDefaults",
    "PlatformError",
    "current_platform",
    "probe_platforms",
    "resolve_platform",
    "set_current_platform",
]
