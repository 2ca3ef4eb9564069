"""model_impl (auto | pagoda | transformers): the engine argument, and how ModelRegistry picks an implementation.

The families and the fallback here are in-process plugins, so these tests hold
whatever model plugins are installed.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.main import app
from pagoda.models.registry import ModelChoice, ModelRegistry, UnsupportedArchitectureError
from pagoda.plugins import API_VERSION, ModelFallbackSpec, ModelSpec, PluginManager, hookimpl

_FALLBACK_MODULE = '''
def check(hf_config, trust_remote_code):
    arch = hf_config.architectures[0]
    if arch.startswith("Alibi"):
        return [f"{arch} computes attention itself"]
    if getattr(hf_config, "needs_remote_code", False) and not trust_remote_code:
        return ["pass trust_remote_code=True"]
    return []


class Generic:
    pass
'''


class Family:
    PAGODA_PLUGIN_API_VERSION = API_VERSION

    @hookimpl
    def pagoda_register_model_families(self) -> list[ModelSpec]:
        return [ModelSpec(architecture="OwnForCausalLM", cls="fake_family:OwnForCausalLM")]


class Fallback:
    PAGODA_PLUGIN_API_VERSION = API_VERSION

    @hookimpl
    def pagoda_register_model_fallbacks(self) -> list[ModelFallbackSpec]:
        return [
            ModelFallbackSpec(
                name="transformers", cls="fake_fallback:Generic", check="fake_fallback:check",
                description="anything not named Alibi*",
            )
        ]


@pytest.fixture
def with_family(isolated_plugin_manager: PluginManager) -> PluginManager:
    isolated_plugin_manager.register(Family(), name="own", kind="model_family", distribution="fake-models-own")
    return isolated_plugin_manager


@pytest.fixture
def with_fallback(with_family: PluginManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    (tmp_path / "fake_fallback.py").write_text(textwrap.dedent(_FALLBACK_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_fallback", raising=False)
    with_family.register(Fallback(), name="generic", kind="model_family", distribution="fake-models-generic")
    return with_family


def test_model_impl_is_an_engine_argument_with_vllms_values() -> None:
    assert EngineArgs().create_engine_config().model.model_impl == "auto"
    for value in ("auto", "pagoda", "transformers"):
        assert EngineArgs(model_impl=value).create_engine_config().model.model_impl == value
    with pytest.raises(ValidationError, match="'auto', 'pagoda' or 'transformers'"):
        EngineArgs(model_impl="vllm")


def test_cli_takes_model_impl_and_trust_remote_code() -> None:
    result = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--model-impl" in result.output and "--trust-remote-code" in result.output


def test_auto_prefers_a_familys_own_implementation(with_fallback: PluginManager) -> None:
    choice = ModelRegistry.resolve(["OwnForCausalLM"], "auto")
    assert choice == ModelChoice("OwnForCausalLM", "fake_family:OwnForCausalLM", "pagoda", "fake-models-own")
    assert choice.describe() == "Serving OwnForCausalLM with fake-models-own (pagoda implementation)"


def test_auto_falls_back_and_transformers_forces_the_fallback(with_fallback: PluginManager) -> None:
    other = ModelRegistry.resolve(["OtherForCausalLM"], "auto", SimpleNamespace(architectures=["OtherForCausalLM"]))
    forced = ModelRegistry.resolve(["OwnForCausalLM"], "transformers")
    for choice in (other, forced):
        assert (choice.implementation, choice.cls, choice.family) == (
            "transformers", "fake_fallback:Generic", "fake-models-generic"
        )
        assert choice.init_kwargs == {"trust_remote_code": False}
    assert forced.describe() == "Serving OwnForCausalLM through the transformers fallback (fake-models-generic)"


def test_pagoda_never_falls_back(with_fallback: PluginManager) -> None:
    with pytest.raises(UnsupportedArchitectureError) as caught:
        ModelRegistry.resolve(["OtherForCausalLM"], "pagoda")
    assert "model_impl='pagoda' excludes the transformers fallback" in str(caught.value)
    assert "Installed model families: fake-models-own: OwnForCausalLM" in str(caught.value)


def test_the_fallbacks_reasons_are_in_the_error(with_fallback: PluginManager) -> None:
    with pytest.raises(UnsupportedArchitectureError) as caught:
        ModelRegistry.resolve(["AlibiForCausalLM"], "auto")
    message = str(caught.value)
    assert "not implemented by any installed model family" in message
    assert "cannot be served by the transformers fallback (fake-models-generic): AlibiForCausalLM computes attention itself" in message
    assert "Installed model families: fake-models-own: OwnForCausalLM" in message


def test_trust_remote_code_reaches_the_fallback(with_fallback: PluginManager) -> None:
    config = SimpleNamespace(architectures=["RemoteForCausalLM"], needs_remote_code=True)
    with pytest.raises(UnsupportedArchitectureError, match="pass trust_remote_code=True"):
        ModelRegistry.resolve(["RemoteForCausalLM"], "auto", config)
    choice = ModelRegistry.resolve(["RemoteForCausalLM"], "auto", config, trust_remote_code=True)
    assert choice.init_kwargs == {"trust_remote_code": True}


def test_without_a_fallback_the_error_says_how_to_get_one(fresh_plugin_manager: PluginManager) -> None:
    # nothing discovered at all: the fallback is not installed
    fresh_plugin_manager.entry_points_loaded = True
    fresh_plugin_manager.register(Family(), name="own", kind="model_family", distribution="fake-models-own")
    for impl in ("auto", "transformers"):
        with pytest.raises(UnsupportedArchitectureError) as caught:
            ModelRegistry.resolve(["OtherForCausalLM"], impl)
        message = str(caught.value)
        assert "the transformers fallback is not installed (pip install pagoda-models-transformers)" in message
        assert "Installed model families: fake-models-own: OwnForCausalLM" in message


def test_an_installed_fallback_left_out_by_pagoda_plugins_is_named(isolated_plugin_manager: PluginManager) -> None:
    isolated_plugin_manager.infos.append(
        _info(name="transformers", distribution="pagoda-models-transformers", status="disabled")
    )
    with pytest.raises(UnsupportedArchitectureError, match="installed but not selected by PAGODA_PLUGINS"):
        ModelRegistry.resolve(["OtherForCausalLM"], "auto")


def test_unknown_model_impl_is_refused(with_fallback: PluginManager) -> None:
    with pytest.raises(ValueError, match="model_impl='vllm' is not one of auto, pagoda, transformers"):
        ModelRegistry.resolve(["OwnForCausalLM"], "vllm")


def test_plugins_list_shows_architectures_family_and_implementation(with_fallback: PluginManager) -> None:
    result = CliRunner().invoke(app, ["plugins", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    section = result.output.partition("\narchitectures:\n")[2].partition("\nplatforms:\n")[0]
    rows = [line.split(None, 2) for line in section.splitlines() if line.strip()]
    assert ["OwnForCausalLM", "fake-models-own", "pagoda"] in rows
    fallback = next(line for line in section.splitlines() if "(any other)" in line)
    assert "fake-models-generic" in fallback and "transformers fallback: anything not named Alibi*" in fallback


def test_plugins_list_architecture_resolves_one_name(with_fallback: PluginManager) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["plugins", "list", "-a", "OtherForCausalLM", "-a", "OwnForCausalLM"])
    assert ok.exit_code == 0, ok.output
    assert "Serving OtherForCausalLM through the transformers fallback (fake-models-generic)" in ok.output
    assert "Serving OwnForCausalLM with fake-models-own (pagoda implementation)" in ok.output
    bad = runner.invoke(app, ["plugins", "list", "-a", "AlibiForCausalLM"])
    assert bad.exit_code == 1 and "AlibiForCausalLM computes attention itself" in bad.output
    forced = runner.invoke(app, ["plugins", "list", "-a", "OwnForCausalLM", "--model-impl", "pagoda"])
    assert forced.exit_code == 0 and "pagoda implementation" in forced.output


def _info(**values: Any) -> Any:
    from pagoda.plugins import PluginInfo

    defaults: dict[str, Any] = dict(kind="model_family", version="0", api_version=None, entry_point=None)
    return PluginInfo(**{**defaults, **values})
