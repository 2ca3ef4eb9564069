"""The plugin contract: API versions, in-process registration through pluggy, loud hook errors."""

from __future__ import annotations

import types

import pytest

from pagoda.lora.request import LoRARequest
from pagoda.lora.resolver import LoRAResolver
from pagoda.plugins import (
    API_VERSION,
    API_VERSION_ATTR,
    ModelSpec,
    PlatformSpec,
    PluginManager,
    check_api_version,
    hookimpl,
)
from pagoda.plugins.manager import requested_plugin_names, supported_api_versions

CORE_MAJOR, CORE_MINOR = (int(p) for p in API_VERSION.split("."))


class ModelFamilyPlugin:
    """A plugin object (not a module) with a decorated hook, as a script would register it."""

    PAGODA_PLUGIN_API_VERSION = API_VERSION

    @hookimpl
    def pagoda_register_model_families(self) -> list[ModelSpec]:
        return [ModelSpec(architecture="TinyForCausalLM", cls="tiny_models:TinyForCausalLM")]


def _plugin_declaring(version: object) -> types.SimpleNamespace:
    plugin = types.SimpleNamespace(
        pagoda_register_platforms=hookimpl(
            lambda: [PlatformSpec(name="fake", cls="fake:Fake", device_type="cpu", package="fake-pkg")]
        )
    )
    if version is not None:
        setattr(plugin, API_VERSION_ATTR, version)
    return plugin


def test_supported_versions_span_the_current_major() -> None:
    assert supported_api_versions() == f"{CORE_MAJOR}.0 to {API_VERSION}"


@pytest.mark.parametrize(
    "declared",
    [f"{CORE_MAJOR}.0", API_VERSION, f"{CORE_MAJOR}.{CORE_MINOR}"],
)
def test_compatible_versions_are_accepted(declared: str) -> None:
    assert check_api_version(declared) is None


@pytest.mark.parametrize(
    ("declared", "why"),
    [
        (None, "does not declare"),
        (f"{CORE_MAJOR + 1}.0", f"targets plugin API {CORE_MAJOR + 1}.0"),
        (f"{CORE_MAJOR}.{CORE_MINOR + 1}", f"targets plugin API {CORE_MAJOR}.{CORE_MINOR + 1}"),
        (f"{CORE_MAJOR - 1}.9", f"targets plugin API {CORE_MAJOR - 1}.9"),
        ("one.zero", "is not of the form 'MAJOR.MINOR'"),
        ("1", "is not of the form 'MAJOR.MINOR'"),
        ("1.0.0", "is not of the form 'MAJOR.MINOR'"),
    ],
)
def test_incompatible_versions_are_refused_naming_supported_versions(declared: object, why: str) -> None:
    problem = check_api_version(declared)
    assert problem is not None
    assert why in problem
    assert supported_api_versions() in problem


@pytest.mark.parametrize("declared", [None, "99.0", f"{CORE_MAJOR}.{CORE_MINOR + 1}", "garbage"])
def test_manager_refuses_incompatible_plugin_without_registering_it(
    isolated_plugin_manager: PluginManager, declared: object
) -> None:
    info = isolated_plugin_manager.register(_plugin_declaring(declared), name="fake-platform", kind="platform")

    assert info.status == "incompatible"
    assert info.error is not None and "fake-platform" in info.error
    assert supported_api_versions() in info.error
    # Refused means its hooks never run: no platform appears.
    assert "fake" not in isolated_plugin_manager.platforms()
    assert info in isolated_plugin_manager.failed(kind="platform")


def test_in_process_registration_through_pluggy(isolated_plugin_manager: PluginManager) -> None:
    plugin = ModelFamilyPlugin()
    info = isolated_plugin_manager.register(plugin, name="tiny-models", kind="model_family")

    assert info.status == "loaded"
    assert info.api_version == API_VERSION
    # pluggy itself dispatches to the registered object ...
    assert isolated_plugin_manager.hook.pagoda_register_model_families() == [
        [ModelSpec(architecture="TinyForCausalLM", cls="tiny_models:TinyForCausalLM")]
    ]
    # ... and the frozen registry holds its spec.
    families = isolated_plugin_manager.model_families()
    assert families["TinyForCausalLM"].cls == "tiny_models:TinyForCausalLM"
    assert info.provides == ["model_families:TinyForCausalLM"]


def test_misspelled_hook_fails_loudly_and_is_recorded(isolated_plugin_manager: PluginManager) -> None:
    class Misspelled:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_register_platfroms(self) -> list[PlatformSpec]:
            return []

    plugin = Misspelled()
    info = isolated_plugin_manager.register(plugin, name="typo", kind="platform")

    assert info.status == "error"
    assert info.error is not None and "pagoda_register_platfroms" in info.error
    assert info.traceback is not None and "PluginValidationError" in info.traceback
    # Unregistered again, so the next plugin's check_pending is not poisoned by it.
    assert not isolated_plugin_manager._pm.is_registered(plugin)
    ok = isolated_plugin_manager.register(ModelFamilyPlugin(), name="tiny-models", kind="model_family")
    assert ok.status == "loaded"


def test_hook_with_unknown_argument_is_an_error(isolated_plugin_manager: PluginManager) -> None:
    class WrongSignature:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_startup(self, config: object, no_such_argument: int) -> None:
            pass

    info = isolated_plugin_manager.register(WrongSignature(), name="bad-args")
    assert info.status == "error"
    assert info.error is not None and "no_such_argument" in info.error


def test_registration_hook_returning_wrong_type_is_reported(isolated_plugin_manager: PluginManager) -> None:
    class WrongReturn:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_register_platforms(self) -> list[object]:
            return ["cpu"]

    info = isolated_plugin_manager.register(WrongReturn(), name="wrong-return", kind="platform")
    assert info.status == "loaded"
    assert isolated_plugin_manager.platforms() == {}
    assert info.status == "error"
    assert info.error is not None and "expected PlatformSpec" in info.error


def test_startup_hook_receives_config(isolated_plugin_manager: PluginManager) -> None:
    seen: list[object] = []

    class General:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_startup(self, config: object) -> None:
            seen.append(config)

    isolated_plugin_manager.register(General(), name="general")
    isolated_plugin_manager.startup(config="the-config")
    assert seen == ["the-config"]


def test_startup_is_historic_a_late_plugin_still_gets_it(isolated_plugin_manager: PluginManager) -> None:
    seen: list[tuple[str, object]] = []

    def general(label: str) -> object:
        class General:
            PAGODA_PLUGIN_API_VERSION = API_VERSION

            @hookimpl
            def pagoda_startup(self, config: object) -> None:
                seen.append((label, config))

        return General()

    isolated_plugin_manager.register(general("early"), name="early")
    isolated_plugin_manager.startup(config="engine-1")
    assert seen == [("early", "engine-1")]
    # registered after the engine started (a script's late register): called at registration
    info = isolated_plugin_manager.register(general("late"), name="late")
    assert info.status == "loaded"
    assert seen == [("early", "engine-1"), ("late", "engine-1")]
    isolated_plugin_manager.startup(config="engine-2")
    assert sorted(seen[2:]) == [("early", "engine-2"), ("late", "engine-2")]  # pluggy calls the newest first


def test_a_late_plugin_whose_startup_raises_is_reported_not_registered(isolated_plugin_manager: PluginManager) -> None:
    class Failing:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_startup(self, config: object) -> None:
            raise RuntimeError("cannot start")

    isolated_plugin_manager.startup(config="engine")
    plugin = Failing()
    info = isolated_plugin_manager.register(plugin, name="failing")
    assert info.status == "error" and info.error is not None and "cannot start" in info.error
    assert not isolated_plugin_manager._pm.is_registered(plugin)


def test_same_platform_from_two_plugins_keeps_the_first(isolated_plugin_manager: PluginManager) -> None:
    def provider(cls_ref: str) -> types.SimpleNamespace:
        plugin = types.SimpleNamespace(
            pagoda_register_platforms=hookimpl(
                lambda: [PlatformSpec(name="dup", cls=cls_ref, device_type="cpu", package="p")]
            )
        )
        setattr(plugin, API_VERSION_ATTR, API_VERSION)
        return plugin

    isolated_plugin_manager.register(provider("first:Platform"), name="first", kind="platform")
    isolated_plugin_manager.register(provider("second:Platform"), name="second", kind="platform")
    assert isolated_plugin_manager.platforms()["dup"].cls == "first:Platform"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("", []),
        (" , ", []),
        ("cpu", ["cpu"]),
        ("cpu, llama ,pagoda-attn-torch", ["cpu", "llama", "pagoda-attn-torch"]),
    ],
)
def test_pagoda_plugins_parsing(raw: str | None, expected: list[str] | None) -> None:
    env = {} if raw is None else {"PAGODA_PLUGINS": raw}
    assert requested_plugin_names(env) == expected


def _platform_spec(name: str, cls_ref: str) -> PlatformSpec:
    return PlatformSpec(name=name, cls=cls_ref, device_type="cpu", package="p")


def test_specname_implementations_are_collected(isolated_plugin_manager: PluginManager) -> None:
    """A hook implemented under another function name (pluggy's ``specname=``) counts like any other."""

    class Renamed:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl(specname="pagoda_register_platforms")
        def platforms(self) -> list[PlatformSpec]:
            return [_platform_spec("renamed", "renamed:Platform")]

        @hookimpl(specname="pagoda_register_model_families")
        def families(self) -> list[ModelSpec]:
            return [ModelSpec(architecture="RenamedForCausalLM", cls="renamed:Model")]

    info = isolated_plugin_manager.register(Renamed(), name="renamed", kind="platform")
    assert info.status == "loaded"
    assert isolated_plugin_manager.platforms()["renamed"].cls == "renamed:Platform"
    assert "RenamedForCausalLM" in isolated_plugin_manager.model_families()
    assert info.provides == ["platforms:renamed", "model_families:RenamedForCausalLM"]


def test_a_plugin_may_implement_one_hook_twice(isolated_plugin_manager: PluginManager) -> None:
    class Twice:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_register_platforms(self) -> list[PlatformSpec]:
            return [_platform_spec("by-name", "twice:A")]

        @hookimpl(specname="pagoda_register_platforms")
        def more_platforms(self) -> list[PlatformSpec]:
            return [_platform_spec("by-specname", "twice:B")]

    info = isolated_plugin_manager.register(Twice(), name="twice", kind="platform")
    assert set(isolated_plugin_manager.platforms()) == {"by-name", "by-specname"}
    assert sorted(info.provides) == ["platforms:by-name", "platforms:by-specname"]


def test_tryfirst_and_trylast_decide_which_provider_of_a_name_wins(isolated_plugin_manager: PluginManager) -> None:
    def provider(cls_ref: str, **opts: bool) -> object:
        class Provider:
            PAGODA_PLUGIN_API_VERSION = API_VERSION

            @hookimpl(**opts)
            def pagoda_register_platforms(self) -> list[PlatformSpec]:
                return [_platform_spec("dup", cls_ref), _platform_spec(cls_ref, cls_ref)]

        return Provider()

    isolated_plugin_manager.register(provider("last", trylast=True), name="last", kind="platform")
    isolated_plugin_manager.register(provider("plain"), name="plain", kind="platform")
    isolated_plugin_manager.register(provider("first", tryfirst=True), name="first", kind="platform")
    platforms = isolated_plugin_manager.platforms()
    assert platforms["dup"].cls == "first"
    assert list(platforms) == ["dup", "first", "plain", "last"]


def test_a_failing_hook_is_attributed_to_its_plugin_alone(isolated_plugin_manager: PluginManager) -> None:
    class Failing:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_register_model_families(self) -> list[ModelSpec]:
            return [ModelSpec(architecture="NeverSeen", cls="failing:Model")]

        @hookimpl(specname="pagoda_register_platforms", tryfirst=True)
        def platforms(self) -> list[PlatformSpec]:
            raise RuntimeError("no platforms today")

    bad = isolated_plugin_manager.register(Failing(), name="failing", kind="platform")
    good = isolated_plugin_manager.register(ModelFamilyPlugin(), name="tiny-models", kind="model_family")
    assert list(isolated_plugin_manager.model_families()) == ["TinyForCausalLM"]
    assert bad.status == "error" and bad.error is not None and "no platforms today" in bad.error
    assert bad.traceback is not None and "platforms" in bad.traceback
    assert good.status == "loaded" and good.provides == ["model_families:TinyForCausalLM"]


def test_a_wrapper_around_a_registration_hook_is_refused(isolated_plugin_manager: PluginManager) -> None:
    class Wrapper:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl(wrapper=True)
        def pagoda_register_platforms(self):  # type: ignore[no-untyped-def]
            return (yield)

    plugin = Wrapper()
    info = isolated_plugin_manager.register(plugin, name="wrapper", kind="platform")
    assert info.status == "error"
    assert info.error is not None and "wrapper" in info.error
    assert not isolated_plugin_manager._pm.is_registered(plugin)


def test_lora_resolver_plugins_are_found_through_the_hook() -> None:
    """A plugin's pagoda_register_lora_resolvers spec becomes a resolver; the filesystem one joins with its directory."""
    import asyncio

    from pagoda.lora.resolver import LoRAResolverRegistry, load_resolvers
    from pagoda.plugins import LoRAResolverSpec, get_plugin_manager, hookimpl

    class Plugin:
        PAGODA_PLUGIN_API_VERSION = "1.6"

        @hookimpl
        def pagoda_register_lora_resolvers(self) -> list[LoRAResolverSpec]:
            return [LoRAResolverSpec(name="test-echo", cls=f"{__name__}:_EchoResolver")]

    pm = get_plugin_manager()
    info = pm.register(Plugin(), name="test-echo-resolver", kind="lora_resolver")
    assert info.status == "loaded", info.error
    try:
        resolvers = load_resolvers()
        echo = LoRAResolverRegistry.get_resolver("test-echo")
        assert echo in resolvers and isinstance(echo, LoRAResolver)
        found = asyncio.run(echo.resolve_lora("base", "sql"))
        assert found == LoRARequest("sql", 1, "/adapters/sql")
    finally:
        LoRAResolverRegistry.resolvers.pop("test-echo", None)



class _EchoResolver(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        return LoRARequest(lora_name, 1, f"/adapters/{lora_name}")
