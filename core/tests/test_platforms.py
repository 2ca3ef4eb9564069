"""Platform resolution: forced or automatic, and never a silent fallback."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pagoda.platforms import (
    DEVICE_ENV,
    Platform,
    PlatformError,
    current_platform,
    probe_platforms,
    resolve_platform,
)
from pagoda.plugins import API_VERSION, PlatformSpec, PluginManager, hookimpl


class FakeAccelerator(Platform):
    name = "fakeaccel"
    device_type = "cpu"
    package = "pagoda-platform-fakeaccel"
    available: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return (True, "") if cls.available else (False, "no fake accelerator is attached")


class FakeHost(Platform):
    name = "fakehost"
    device_type = "cpu"
    package = "pagoda-platform-fakehost"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, ""


class NeverAvailable(Platform):
    name = "never"
    device_type = "cpu"
    package = "pagoda-platform-never"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return False, "this machine has no never-device"


class ProbeRaises(Platform):
    name = "raising"
    device_type = "cpu"
    package = "pagoda-platform-raising"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        raise ImportError("libfake.so: cannot open shared object file")


def _ref(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class PlatformPlugin:
    """An in-process platform plugin providing one platform class."""

    PAGODA_PLUGIN_API_VERSION = API_VERSION

    def __init__(self, cls: type[Platform], priority: int) -> None:
        self.spec = PlatformSpec(
            name=cls.name, cls=_ref(cls), device_type=cls.device_type, package=cls.package, priority=priority
        )

    @hookimpl
    def pagoda_register_platforms(self) -> list[PlatformSpec]:
        return [self.spec]


class BrokenPlatformPlugin:
    """A platform plugin whose registration hook raises (as a half-installed plugin might)."""

    PAGODA_PLUGIN_API_VERSION = API_VERSION

    @hookimpl
    def pagoda_register_platforms(self) -> list[PlatformSpec]:
        raise OSError("driver library missing")


@pytest.fixture
def pm(isolated_plugin_manager: PluginManager) -> PluginManager:
    FakeAccelerator.available = True
    return isolated_plugin_manager


def _install(pm: PluginManager, cls: type[Platform], priority: int = 0) -> None:
    info = pm.register(PlatformPlugin(cls, priority), name=cls.name, kind="platform")
    assert info.status == "loaded", info.error


def test_auto_picks_the_highest_priority_available_platform(pm: PluginManager) -> None:
    _install(pm, FakeHost, priority=0)
    _install(pm, FakeAccelerator, priority=100)
    _install(pm, NeverAvailable, priority=1000)

    assert isinstance(resolve_platform(), FakeAccelerator)
    assert isinstance(resolve_platform("auto"), FakeAccelerator)


def test_auto_skips_unavailable_higher_priority_platform(pm: PluginManager) -> None:
    FakeAccelerator.available = False
    _install(pm, FakeHost, priority=0)
    _install(pm, FakeAccelerator, priority=100)

    assert isinstance(resolve_platform(), FakeHost)


def test_forced_platform_that_is_not_installed_names_the_package(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    with pytest.raises(PlatformError) as caught:
        resolve_platform("cuda")
    message = str(caught.value)
    assert "'cuda'" in message
    assert "pagoda-platform-cuda" in message
    assert "Installed platforms: fakehost" in message


def test_forced_unknown_platform_says_what_to_install(pm: PluginManager) -> None:
    with pytest.raises(PlatformError, match="a package providing platform 'quantum'"):
        resolve_platform("quantum")


def test_forced_platform_that_cannot_run_is_an_error_not_a_fallback(pm: PluginManager) -> None:
    FakeAccelerator.available = False
    _install(pm, FakeHost)
    _install(pm, FakeAccelerator, priority=100)

    with pytest.raises(PlatformError) as caught:
        resolve_platform("fakeaccel")
    message = str(caught.value)
    assert "'fakeaccel'" in message
    assert "pagoda-platform-fakeaccel" in message
    assert "no fake accelerator is attached" in message


def test_forced_platform_whose_probe_raises_reports_the_reason(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    _install(pm, ProbeRaises)

    with pytest.raises(PlatformError) as caught:
        resolve_platform("raising")
    assert "libfake.so" in str(caught.value)
    assert "'raising'" in str(caught.value)


def test_auto_with_a_broken_platform_plugin_is_an_error(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    pm.register(BrokenPlatformPlugin(), name="brokenplat", kind="platform", distribution="pagoda-platform-broken")

    with pytest.raises(PlatformError) as caught:
        resolve_platform()
    message = str(caught.value)
    assert "brokenplat" in message
    assert "driver library missing" in message
    assert "never silently falls back" in message


def test_broken_platform_plugin_does_not_block_an_explicit_choice(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    pm.register(BrokenPlatformPlugin(), name="brokenplat", kind="platform")

    assert isinstance(resolve_platform("fakehost"), FakeHost)


def test_none_available_lists_every_reason(pm: PluginManager) -> None:
    FakeAccelerator.available = False
    _install(pm, FakeAccelerator)
    _install(pm, NeverAvailable)
    _install(pm, ProbeRaises)

    with pytest.raises(PlatformError) as caught:
        resolve_platform()
    message = str(caught.value)
    assert "no installed platform can run here" in message
    assert "fakeaccel (pagoda-platform-fakeaccel): no fake accelerator is attached" in message
    assert "never (pagoda-platform-never): this machine has no never-device" in message
    assert "raising (pagoda-platform-raising): probe failed: ImportError" in message


def test_no_platform_installed_says_what_to_install(pm: PluginManager) -> None:
    with pytest.raises(PlatformError, match="pip install pagoda-platform-cpu"):
        resolve_platform()


def test_pagoda_device_env_is_honoured(pm: PluginManager, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(pm, FakeHost, priority=0)
    _install(pm, FakeAccelerator, priority=100)

    monkeypatch.setenv(DEVICE_ENV, "fakehost")
    assert isinstance(resolve_platform(), FakeHost)
    # An explicit device argument beats the environment.
    assert isinstance(resolve_platform("fakeaccel"), FakeAccelerator)

    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(PlatformError, match="pagoda-platform-cuda"):
        resolve_platform()


def test_probe_platforms_reports_each_platform(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    _install(pm, NeverAvailable)
    _install(pm, ProbeRaises)

    rows = {name: (ok, reason) for name, ok, reason in probe_platforms()}
    assert rows["fakehost"] == (True, "")
    assert rows["never"] == (False, "this machine has no never-device")
    assert rows["raising"][0] is False and "libfake.so" in rows["raising"][1]


def test_current_platform_is_resolved_once(pm: PluginManager) -> None:
    _install(pm, FakeHost)
    first = current_platform()
    assert isinstance(first, FakeHost)
    assert current_platform() is first


def test_importing_pagoda_resolves_no_platform() -> None:
    import subprocess
    import sys

    code = (
        "import pagoda, pagoda.platforms as p, pagoda.plugins as pl;"
        "assert p._current is None, 'platform resolved at import';"
        "assert pl._manager is None, 'plugins loaded at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _platform_uses_in_core() -> tuple[dict[str, set[str]], list[str]]:
    """Names core reads on a platform object, and any getattr/hasattr probes of one.

    A platform object is spelled ``platform``, ``<anything>.platform``,
    ``current_platform()`` or ``resolve_platform()`` in core's sources; files that
    import the stdlib ``platform`` module are skipped.
    """
    import ast
    from pathlib import Path

    import pagoda

    def is_platform(node: ast.AST) -> bool:
        return (
            (isinstance(node, ast.Name) and node.id == "platform")
            or (isinstance(node, ast.Attribute) and node.attr == "platform")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("current_platform", "resolve_platform"))
        )

    used: dict[str, set[str]] = {}
    probes: list[str] = []
    for path in sorted(Path(pagoda.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.Import) and any(a.name == "platform" for a in n.names) for n in ast.walk(tree)):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_platform(node.value):
                used.setdefault(node.attr, set()).add(path.name)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args and is_platform(node.args[0])):
                probes.append(f"{path.name}:{node.lineno}")
    return used, probes


def test_everything_core_calls_on_a_platform_is_declared_on_the_interface() -> None:
    used, probes = _platform_uses_in_core()
    assert {"is_pin_memory_available", "kv_cache_budget_bytes", "resolve_dtype", "graph_capturer",
            "measures_activation_peak"} <= set(used)  # the scan sees calls
    undeclared = {name: sorted(files) for name, files in used.items() if not hasattr(Platform, name)}
    assert undeclared == {}, f"declare these on pagoda.platforms.Platform: {undeclared}"
    assert probes == [], f"core probes a platform with getattr/hasattr instead of the interface: {probes}"


def _model_probes_in_core() -> list[str]:
    """``getattr``/``hasattr`` calls in core's sources that probe a model for a capability.

    A probe is one whose object is spelled ``model`` or ``<anything>.model``, or whose attribute
    name is a capability's (a member of a ``pagoda.models.interface`` capability class, or one of the
    flags that declared capabilities before those classes did), on any object.
    """
    import ast
    from pathlib import Path

    import pagoda
    from pagoda.models import interface

    capabilities = (interface.PoolingModel, interface.SupportsPP, interface.SupportsQuant,
                    interface.SupportsOutputRows, interface.SupportsTokenTypeIds, interface.NoCudaGraphs)
    names = {name for cap in capabilities for name in vars(cap) if not name.startswith("_")}
    names |= {"supports_pp", "supports_quant", "supports_output_rows", "uses_token_type_ids", "is_pooling_model",
              "supports_cuda_graphs", "pooler", "make_empty_intermediate_tensors"}
    assert {"packed_modules_mapping", "quant_unsupported_reason", "map_checkpoint_name"} <= names  # the scan sees members

    def is_model(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "model") or (
            isinstance(node, ast.Attribute) and node.attr == "model")

    probes: list[str] = []
    for path in sorted(Path(pagoda.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            target, attr = node.args[0], node.args[1]
            named = isinstance(attr, ast.Constant) and attr.value in names
            if is_model(target) or named:
                probes.append(f"{path.relative_to(Path(pagoda.__file__).parent)}:{node.lineno}")
    return probes


def test_core_reads_model_capabilities_through_the_interface() -> None:
    probes = _model_probes_in_core()
    assert probes == [], (f"core probes a model with getattr/hasattr instead of pagoda.models.interface's "
                          f"capability helpers (supports_pp, supports_quant, ...): {probes}")


def test_interface_defaults() -> None:
    import torch

    from pagoda.config import EngineArgs

    class Host(FakeHost):
        pass

    class Gpu(FakeHost):
        device_type = "cuda"

    host = Host()
    config = EngineArgs(max_model_len=256).create_engine_config()
    assert host.is_pin_memory_available(config) is False
    assert Gpu().is_pin_memory_available(config) is True
    assert host.cuda_graph_capture_sizes(config) == []
    assert host.linear_kernel(torch.float32) is None and host.layer_ops(torch.float32) is None
    assert host.attention_backend_preference() == [] and host.memory_stats() == {}
    assert host.device() == torch.device("cpu") and host.describe() == "fakehost"
    cache = torch.zeros(4)
    assert host.prefault_kv_cache([cache]) is None and cache.sum().item() == 0.0  # the default does nothing
    with pytest.raises(NotImplementedError):
        host.kv_cache_budget_bytes(config, 0, 0)
    # a device whose memory the activations share measures the peak unless the platform says otherwise
    assert host.measures_activation_peak is True
    capturer, why_not = host.graph_capturer([])
    assert capturer is None and "no graph runtime" in why_not


def test_graph_capture_asks_the_platform_not_the_device_type() -> None:
    """pagoda.worker.graphs gets its capturer (and so CUDA's sync, memory and copy events) from the
    platform: a device-type branch there would be a platform decision made outside the platform."""
    import ast
    from pathlib import Path

    import pagoda.worker.graphs as graphs

    tree = ast.parse(Path(graphs.__file__).read_text())
    branches = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "type"
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "device"]
    assert branches == [], f"device.type read in pagoda/worker/graphs.py at lines {branches}"
