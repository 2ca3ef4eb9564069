"""Which IO processor an engine gets: the engine argument, else the model config's key; unknown names are errors."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.config import EngineArgs, EngineConfig, ResolvedModel
from pagoda.plugins import API_VERSION, IOProcessorSpec, PluginError, PluginManager, hookimpl
from pagoda.plugins.io_processors import IOProcessor, IOProcessorResponse, get_io_processor, requested_io_processor


class UpperProcessor(IOProcessor[str, list[str]]):
    """Upper-cases ``data["text"]`` into one prompt; answers the prompts' token counts."""

    def parse_request(self, request: Any) -> str:
        data = request["data"] if isinstance(request, dict) else request.data
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise ValueError("data.text must be a string")
        return str(data["text"])

    def pre_process(self, prompt: str, request_id: str | None = None, **kwargs: Any) -> str:
        return prompt.upper()

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any) -> list[str]:
        return [str(o) for o in model_output]

    def output_to_response(self, plugin_output: list[str]) -> IOProcessorResponse:
        return IOProcessorResponse(data=plugin_output)


class NotAProcessor:
    pass


class ProcessorsPlugin:
    PAGODA_PLUGIN_API_VERSION = API_VERSION

    @hookimpl
    def pagoda_register_io_processors(self) -> list[IOProcessorSpec]:
        return [
            IOProcessorSpec(name="upper", cls=f"{__name__}:UpperProcessor"),
            IOProcessorSpec(name="broken", cls=f"{__name__}:NotAProcessor"),
        ]


@pytest.fixture
def registered(fresh_plugin_manager: PluginManager) -> PluginManager:
    info = fresh_plugin_manager.register(ProcessorsPlugin(), name="processors", kind="io_processor")
    assert info.status == "loaded", info.error
    assert set(fresh_plugin_manager.io_processors()) == {"upper", "broken"}
    assert info.provides == ["io_processors:upper", "io_processors:broken"]
    return fresh_plugin_manager


def _config(plugin: str | None = None, model_key: str | None = None) -> EngineConfig:
    config = EngineArgs(io_processor_plugin=plugin).create_engine_config()
    hf_config = SimpleNamespace(io_processor_plugin=model_key) if model_key else SimpleNamespace()
    config.resolved_model = ResolvedModel(source=None, hf_config=hf_config, text_config=hf_config, dtype=None,
                                          max_model_len=16, vocab_size=0)
    return config


def test_none_asked_none_built(registered: PluginManager) -> None:
    assert get_io_processor(_config()) is None


def test_engine_argument_then_model_config_key(registered: PluginManager) -> None:
    assert requested_io_processor(_config(model_key="upper")) == "upper"
    assert requested_io_processor(_config("other", model_key="upper"), "other") == "other"
    processor = get_io_processor(_config(model_key="upper"))
    assert isinstance(processor, UpperProcessor) and processor.config.model.io_processor_plugin is None
    config = _config("upper")
    built = get_io_processor(config, config.model.io_processor_plugin)
    assert isinstance(built, UpperProcessor) and built.config is config


def test_the_flow_and_its_defaults(registered: PluginManager) -> None:
    import asyncio

    processor = get_io_processor(_config("upper"), "upper")
    assert processor is not None
    assert processor.parse_request({"data": {"text": "hi"}}) == "hi"
    with pytest.raises(ValueError, match="data.text"):
        processor.parse_request({"data": 3})

    async def outputs() -> Any:
        for i, out in [(1, "b"), (0, "a")]:
            yield i, out

    # post_process_async hands post_process the outputs in prompt order
    assert asyncio.run(processor.post_process_async(outputs())) == ["a", "b"]
    assert asyncio.run(processor.pre_process_async("hi")) == "HI"
    assert processor.output_to_response(["a"]).model_dump()["data"] == ["a"]


def test_unknown_name_lists_the_installed_processors(registered: PluginManager) -> None:
    with pytest.raises(PluginError, match=r"'nope'.*installed IO processors: broken, upper"):
        get_io_processor(_config("nope"), "nope")
    with pytest.raises(PluginError, match=r"model config's 'io_processor_plugin'.*'nope'"):
        get_io_processor(_config(model_key="nope"))


def test_a_class_that_is_no_io_processor_is_refused(registered: PluginManager) -> None:
    with pytest.raises(PluginError, match="not a pagoda.plugins.io_processors.IOProcessor subclass"):
        get_io_processor(_config("broken"), "broken")
