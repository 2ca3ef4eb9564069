"""`pagoda plugins list|info` and `pagoda --version`, in-process and as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagoda.entrypoints.cli.main import app
from pagoda.plugins import PluginManager
from pagoda.version import __version__

NON_CPU_PLATFORMS = ("cuda", "rocm", "tpu")


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _plugin_line(output: str, name: str) -> str:
    plugin_section = output.partition("\nplatforms:\n")[0]
    lines = [line for line in plugin_section.splitlines() if line.split() and line.split()[0] == name]
    assert len(lines) == 1, f"expected one line for {name!r} in:\n{output}"
    return lines[0]


def _platform_rows(output: str) -> dict[str, str]:
    """The `platforms:` section as {name: 'available' | 'unavailable: reason ...'}."""
    _, _, section = output.partition("\nplatforms:\n")
    rows: dict[str, str] = {}
    for line in section.splitlines():
        name, _, state = line.strip().partition(" ")
        if name:
            rows[name] = state.strip()
    return rows


def _platforms_this_torch_cannot_run() -> list[str]:
    """The accelerator platforms that must be unavailable here, judged without the plugins' own probes."""
    import importlib.util

    import torch

    has_runtime = {
        "cuda": torch.version.cuda is not None,
        "rocm": getattr(torch.version, "hip", None) is not None,
        "tpu": importlib.util.find_spec("torch_xla") is not None,
    }
    return [name for name in NON_CPU_PLATFORMS if not has_runtime[name]]


def test_version() -> None:
    code, output = _invoke("--version")
    assert code == 0
    assert output.strip() == f"pagoda {__version__}"


def test_help_lists_the_plugins_command() -> None:
    code, output = _invoke("--help")
    assert code == 0
    assert "plugins" in output


def test_list_on_the_real_install_shows_cpu_available_and_the_others_unavailable(
    fresh_plugin_manager: PluginManager,
) -> None:
    code, output = _invoke("plugins", "list")
    assert code == 0, output

    cpu = _plugin_line(output, "cpu")
    assert "platform" in cpu and "pagoda-platform-cpu" in cpu and cpu.rstrip().endswith("loaded")
    assert "provides: platforms:cpu" in output

    rows = _platform_rows(output)
    assert rows["cpu"] == "available"
    for name in _platforms_this_torch_cannot_run():
        assert rows[name].startswith("unavailable: "), rows
        reason = rows[name].removeprefix("unavailable: ").removesuffix("[not verified on hardware]").strip()
        assert reason, f"{name} is unavailable without a reason"


def test_list_reports_a_broken_plugin_and_still_lists_the_rest(
    fresh_plugin_manager: PluginManager, good_platform_dist: object, broken_plugin_dist: object
) -> None:
    code, output = _invoke("plugins", "list")
    assert code == 0, output

    broken = _plugin_line(output, "brokenattn")
    assert "attention_backend" in broken and "pagoda-test-broken 0.0.1" in broken
    assert broken.rstrip().endswith("error")
    assert "error: failed to import pagoda_test_broken: RuntimeError: the broken plugin cannot import" in output

    good = _plugin_line(output, "goodplat")
    assert "pagoda-test-goodplat 1.2.3" in good and good.rstrip().endswith("loaded")
    rows = _platform_rows(output)
    assert rows["goodplat"] == "unavailable: the good platform is never available in tests"
    assert rows["cpu"] == "available"


def test_info_shows_the_traceback_of_a_broken_plugin(
    fresh_plugin_manager: PluginManager, broken_plugin_dist: object
) -> None:
    code, output = _invoke("plugins", "info", "brokenattn")
    assert code == 0, output
    assert "status:       error" in output
    assert "distribution: pagoda-test-broken 0.0.1" in output
    assert "entry point:  pagoda_test_broken" in output
    assert "Traceback (most recent call last)" in output
    assert 'raise RuntimeError("the broken plugin cannot import")' in output


def test_info_by_distribution_name(fresh_plugin_manager: PluginManager, good_platform_dist: object) -> None:
    code, output = _invoke("plugins", "info", "pagoda-test-goodplat")
    assert code == 0, output
    assert "name:         goodplat" in output
    assert "status:       loaded" in output
    assert "provides:     platforms:goodplat" in output


def test_info_unknown_name_lists_installed(fresh_plugin_manager: PluginManager) -> None:
    code, output = _invoke("plugins", "info", "no-such-plugin")
    assert code == 1
    assert "no plugin named 'no-such-plugin'" in output
    assert "cpu" in output


def test_list_with_misspelled_pagoda_plugins_fails_naming_it(
    fresh_plugin_manager: PluginManager, clean_plugin_env: pytest.MonkeyPatch
) -> None:
    clean_plugin_env.setenv("PAGODA_PLUGINS", "cpu,lama")
    code, output = _invoke("plugins", "list")
    assert code == 2
    assert "lama" in output
    assert "Installed plugins:" in output and "llama" in output


def test_list_as_a_real_process_reports_the_broken_plugin(
    plugin_site: Path, good_platform_dist: object, broken_plugin_dist: object
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGODA_PLUGINS", "PAGODA_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), *filter(None, [env.get("PYTHONPATH")])])
    env["COLUMNS"] = "200"
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli.main", "plugins", "list"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert _plugin_line(proc.stdout, "brokenattn").rstrip().endswith("error")
    assert "RuntimeError: the broken plugin cannot import" in proc.stdout
    assert _plugin_line(proc.stdout, "goodplat").rstrip().endswith("loaded")
    assert _platform_rows(proc.stdout)["cpu"] == "available"
