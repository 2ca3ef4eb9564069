"""Shared fixtures for core's tests: a fresh plugin manager and real on-disk plugin distributions."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import pagoda.platforms as platforms_module
import pagoda.plugins as plugins_module
from pagoda.plugins import PluginManager, get_plugin_manager, reset_plugin_manager

# Environment variables that change which plugins load and which platform is chosen.
PLUGIN_ENV_VARS = ("PAGODA_PLUGINS", "PAGODA_DEVICE")


@pytest.fixture
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Unset the variables that select plugins and platforms, so the caller's shell cannot leak in."""
    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def fresh_plugin_manager(clean_plugin_env: pytest.MonkeyPatch) -> Iterator[PluginManager]:
    """The process-wide plugin manager, new and with no entry points loaded yet.

    The manager and resolved platform that existed before the test are put back
    afterwards, so tests never see each other's registrations.
    """
    saved_manager = plugins_module._manager
    saved_platform = platforms_module._current
    reset_plugin_manager()
    platforms_module.set_current_platform(None)
    try:
        yield get_plugin_manager(load=False)
    finally:
        plugins_module._manager = saved_manager
        platforms_module.set_current_platform(saved_platform)


@pytest.fixture
def isolated_plugin_manager(fresh_plugin_manager: PluginManager, clean_plugin_env: pytest.MonkeyPatch) -> PluginManager:
    """A fresh manager that has loaded *no* installed plugin (``PAGODA_PLUGINS=""``).

    Tests register their own plugins in-process; ``get_plugin_manager()`` then
    returns this manager without discovering anything else.
    """
    clean_plugin_env.setenv("PAGODA_PLUGINS", "")
    fresh_plugin_manager.load_entry_points()
    return fresh_plugin_manager


@dataclass(frozen=True)
class PluginDist:
    """A plugin distribution written to disk: its site directory, names and entry point."""

    site_dir: Path
    distribution: str
    version: str
    module: str
    entry_point_name: str
    group: str


PluginDistFactory = Callable[..., PluginDist]


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` that plugin distributions can be written into."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = set(sys.modules)
    yield site
    # Modules imported from the temporary site must not leak into later tests.
    for name in set(sys.modules) - before:
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if module_file.startswith(str(site)):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def make_plugin_dist(plugin_site: Path) -> PluginDistFactory:
    """Write an installed distribution (module + ``*.dist-info``) that importlib.metadata finds.

    This is what pip leaves behind for a wheel, minus RECORD: a METADATA file and
    an entry_points.txt naming the plugin module in a ``pagoda.*`` group.
    """

    def make(
        distribution: str,
        module: str,
        source: str,
        entry_point_name: str | None = None,
        group: str = "pagoda.general",
        version: str = "0.0.1",
    ) -> PluginDist:
        ep_name = entry_point_name or distribution
        (plugin_site / f"{module}.py").write_text(textwrap.dedent(source))
        dist_info = plugin_site / f"{distribution.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        (dist_info / "entry_points.txt").write_text(f"[{group}]\n{ep_name} = {module}\n")
        importlib.invalidate_caches()
        return PluginDist(plugin_site, distribution, version, module, ep_name, group)

    return make


# A platform plugin module as a third party would ship it: specs only, and the
# Platform class it names lives in the same module (a real one would import it lazily).
GOOD_PLATFORM_PLUGIN = '''
from pagoda.platforms.interface import Platform
from pagoda.plugins import PlatformSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


class GoodPlatform(Platform):
    name = "goodplat"
    device_type = "cpu"
    package = "pagoda-test-goodplat"

    @classmethod
    def probe(cls):
        return False, "the good platform is never available in tests"


@hookimpl
def pagoda_register_platforms():
    return [
        PlatformSpec(
            name="goodplat",
            cls="pagoda_test_goodplat:GoodPlatform",
            device_type="cpu",
            package="pagoda-test-goodplat",
            priority=-100,
        )
    ]
'''

BROKEN_PLUGIN = '''
PAGODA_PLUGIN_API_VERSION = "1.0"

raise RuntimeError("the broken plugin cannot import")
'''

NO_VERSION_PLUGIN = '''
from pagoda.plugins import hookimpl


@hookimpl
def pagoda_startup(config):
    pass
'''


@pytest.fixture
def good_platform_dist(make_plugin_dist: PluginDistFactory) -> PluginDist:
    """An installed platform plugin (entry point ``goodplat``) whose platform never probes as available."""
    return make_plugin_dist(
        "pagoda-test-goodplat", "pagoda_test_goodplat", GOOD_PLATFORM_PLUGIN,
        entry_point_name="goodplat", group="pagoda.platforms", version="1.2.3",
    )


@pytest.fixture
def broken_plugin_dist(make_plugin_dist: PluginDistFactory) -> PluginDist:
    """An installed attention-backend plugin (entry point ``brokenattn``) whose import raises."""
    return make_plugin_dist(
        "pagoda-test-broken", "pagoda_test_broken", BROKEN_PLUGIN,
        entry_point_name="brokenattn", group="pagoda.attention_backends",
    )


@pytest.fixture
def no_version_plugin_dist(make_plugin_dist: PluginDistFactory) -> PluginDist:
    """An installed general plugin (entry point ``noversion``) that declares no plugin-API version."""
    return make_plugin_dist("pagoda-test-noversion", "pagoda_test_noversion", NO_VERSION_PLUGIN, entry_point_name="noversion")
