"""Entry-point discovery against real installed distributions (dist-info on sys.path)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest
from importlib_metadata import distribution, entry_points

from pagoda.plugins import PluginManager, PluginSelectionError, get_plugin_manager, load_plugins

if TYPE_CHECKING:
    from pagoda.plugins import PluginInfo

    from .conftest import PluginDistFactory


def _info(pm: PluginManager, name: str) -> PluginInfo:
    matches = [i for i in pm.infos if i.name == name]
    assert len(matches) == 1, f"expected one record for {name!r}, got {matches}"
    return matches[0]


def test_importlib_metadata_sees_the_written_distribution(good_platform_dist: object) -> None:
    dist = distribution("pagoda-test-goodplat")
    assert dist.version == "1.2.3"
    names = {ep.name for ep in entry_points(group="pagoda.platforms")}
    assert "goodplat" in names


def test_manager_loads_installed_plugin_with_its_distribution(
    fresh_plugin_manager: PluginManager, good_platform_dist: object
) -> None:
    fresh_plugin_manager.load_entry_points()

    info = _info(fresh_plugin_manager, "goodplat")
    assert (info.status, info.kind) == ("loaded", "platform")
    assert (info.distribution, info.version) == ("pagoda-test-goodplat", "1.2.3")
    assert info.entry_point == "pagoda_test_goodplat"
    assert info.api_version == "1.0"
    spec = fresh_plugin_manager.platforms()["goodplat"]
    assert spec.package == "pagoda-test-goodplat"
    assert info.provides == ["platforms:goodplat"]


def test_broken_plugin_is_recorded_and_the_others_still_load(
    fresh_plugin_manager: PluginManager, good_platform_dist: object, broken_plugin_dist: object
) -> None:
    fresh_plugin_manager.load_entry_points()

    broken = _info(fresh_plugin_manager, "brokenattn")
    assert broken.status == "error"
    assert broken.distribution == "pagoda-test-broken"
    assert broken.error is not None and "RuntimeError: the broken plugin cannot import" in broken.error
    assert broken.traceback is not None
    assert "Traceback (most recent call last)" in broken.traceback
    assert "pagoda_test_broken.py" in broken.traceback
    assert broken in fresh_plugin_manager.failed(kind="attention_backend")

    assert _info(fresh_plugin_manager, "goodplat").status == "loaded"
    assert "goodplat" in fresh_plugin_manager.platforms()


def test_plugin_without_api_version_is_refused_at_load(
    fresh_plugin_manager: PluginManager, no_version_plugin_dist: object
) -> None:
    fresh_plugin_manager.load_entry_points()

    info = _info(fresh_plugin_manager, "noversion")
    assert info.status == "incompatible"
    assert info.error is not None and "does not declare PAGODA_PLUGIN_API_VERSION" in info.error


def test_unset_pagoda_plugins_loads_all(
    fresh_plugin_manager: PluginManager, good_platform_dist: object, broken_plugin_dist: object
) -> None:
    fresh_plugin_manager.load_entry_points()
    statuses = {i.name: i.status for i in fresh_plugin_manager.infos}
    assert statuses["goodplat"] == "loaded"
    assert statuses["brokenattn"] == "error"
    assert "disabled" not in statuses.values()


def test_empty_pagoda_plugins_loads_none(
    fresh_plugin_manager: PluginManager, clean_plugin_env: pytest.MonkeyPatch, good_platform_dist: object
) -> None:
    clean_plugin_env.setenv("PAGODA_PLUGINS", "")
    fresh_plugin_manager.load_entry_points()

    assert fresh_plugin_manager.infos, "installed plugins are still listed"
    assert {i.status for i in fresh_plugin_manager.infos} == {"disabled"}
    assert fresh_plugin_manager.platforms() == {}
    assert "pagoda_test_goodplat" not in sys.modules


@pytest.mark.parametrize("selector", ["goodplat", "pagoda-test-goodplat"])
def test_pagoda_plugins_selects_by_entry_point_or_distribution_name(
    fresh_plugin_manager: PluginManager,
    clean_plugin_env: pytest.MonkeyPatch,
    good_platform_dist: object,
    broken_plugin_dist: object,
    selector: str,
) -> None:
    clean_plugin_env.setenv("PAGODA_PLUGINS", f" {selector} ,")
    fresh_plugin_manager.load_entry_points()

    assert _info(fresh_plugin_manager, "goodplat").status == "loaded"
    # The broken one was not selected, so it is never imported and never an error.
    broken = _info(fresh_plugin_manager, "brokenattn")
    assert broken.status == "disabled"
    assert broken.error == "not selected by PAGODA_PLUGINS"
    assert list(fresh_plugin_manager.platforms()) == ["goodplat"]


def test_misspelled_pagoda_plugins_name_lists_installed_names(
    fresh_plugin_manager: PluginManager, clean_plugin_env: pytest.MonkeyPatch, good_platform_dist: object
) -> None:
    clean_plugin_env.setenv("PAGODA_PLUGINS", "goodplat,godplat")
    with pytest.raises(PluginSelectionError) as caught:
        fresh_plugin_manager.load_entry_points()
    message = str(caught.value)
    assert "godplat" in message
    assert "Installed plugins:" in message
    assert "goodplat" in message.split("Installed plugins:")[1]
    assert not fresh_plugin_manager.entry_points_loaded


def test_get_plugin_manager_loads_entry_points_once(fresh_plugin_manager: PluginManager, good_platform_dist: object) -> None:
    pm = get_plugin_manager()
    assert pm is fresh_plugin_manager
    count = len(pm.infos)
    assert get_plugin_manager() is pm
    assert len(pm.infos) == count


def test_worker_loads_exactly_the_names_decided_by_the_main_process(
    fresh_plugin_manager: PluginManager,
    clean_plugin_env: pytest.MonkeyPatch,
    good_platform_dist: object,
    broken_plugin_dist: object,
) -> None:
    import pagoda.plugins as plugins_module

    plugins_module.reset_plugin_manager()
    # The worker's own environment must not override the main process's decision.
    clean_plugin_env.setenv("PAGODA_PLUGINS", "brokenattn")
    pm = load_plugins(["goodplat"])

    assert _info(pm, "goodplat").status == "loaded"
    assert _info(pm, "brokenattn").status == "disabled"
    assert pm.loaded_names() == ["goodplat"]


ENV_VAR_PLUGIN = '''
from pagoda import envs
from pagoda.envs import EnvVar, parse_bool
from pagoda.plugins import hookimpl

PAGODA_PLUGIN_API_VERSION = "1.5"
SWITCH = EnvVar("PAGODA_TEST_DIST_SWITCH", "bool", True, "A test distribution's switch.", "pagoda-test-envvars",
                parse_bool)
# read at import, while the manager is still loading plugins: must not start loading them again
SEEN_AT_IMPORT = getattr(envs, "PAGODA_TEST_DIST_SWITCH", "undeclared")


@hookimpl
def pagoda_add_env_vars(registry):
    registry.add(SWITCH)
'''


def test_an_installed_plugin_declares_its_variables_once_loaded(
    fresh_plugin_manager: PluginManager, make_plugin_dist: PluginDistFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda import envs

    make_plugin_dist("pagoda-test-envvars", "pagoda_test_envvars", ENV_VAR_PLUGIN, entry_point_name="envvars")
    monkeypatch.setenv("PAGODA_PLUGINS", "envvars")
    monkeypatch.setenv("PAGODA_TEST_DIST_SWITCH", "0")
    try:
        assert envs.PAGODA_TEST_DIST_SWITCH is False  # an unknown name loads the process's plugins first
        assert _info(fresh_plugin_manager, "envvars").status == "loaded"  # loaded once, not again from inside
        assert sys.modules["pagoda_test_envvars"].SEEN_AT_IMPORT == "undeclared"
        assert envs.all_variables()["PAGODA_TEST_DIST_SWITCH"].read_by == "pagoda-test-envvars"
    finally:
        envs.ENVIRONMENT_VARIABLES.pop("PAGODA_TEST_DIST_SWITCH", None)
