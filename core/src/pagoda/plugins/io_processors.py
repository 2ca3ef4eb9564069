"""IO processor plugins (vLLM's ``IOProcessor``): custom requests in, custom responses out, a pooling model between.

A plugin in the ``pagoda.io_processors`` entry-point group returns an
``IOProcessorSpec(name, cls)`` from ``pagoda_register_io_processors``; ``cls``
names an ``IOProcessor`` subclass. One processor is chosen per engine, by
``io_processor_plugin=NAME`` (``--io-processor-plugin``) or, failing that, by an
``io_processor_plugin`` key in the model's ``config.json`` (vLLM's two ways).
It runs in the front end only (``LLM.encode`` and the server's ``/pooling``),
never in the engine core, so nothing about it is shipped to workers.

The flow of one request is vLLM's: ``parse_request`` checks the request's
``data``, ``pre_process`` turns it into one or more prompts,
``validate_or_generate_params`` gives the ``PoolingParams`` they run with, the
engine pools each prompt, ``post_process`` folds the outputs (in prompt order)
into the plugin's output, and the server answers ``output_to_response`` of it.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, Field

from pagoda.plugins.manager import PluginError

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)

IOProcessorInput = TypeVar("IOProcessorInput")
IOProcessorOutput = TypeVar("IOProcessorOutput")

# The model config key that names a model's own processor (vLLM's).
CONFIG_KEY = "io_processor_plugin"


class IOProcessorResponse(BaseModel):
    """What ``/pooling`` answers for a plugin request: the plugin's ``data``, as vLLM shapes it."""

    request_id: str | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    data: Any


class IOProcessor(ABC, Generic[IOProcessorInput, IOProcessorOutput]):
    """vLLM's IOProcessor interface; ``config`` is the engine's ``EngineConfig`` (vLLM passes its ``VllmConfig``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def parse_request(self, request: Any) -> IOProcessorInput:
        """Check a request and return the plugin's input. ``request`` is the server's ``IOProcessorRequest``
        (its ``data`` holds the plugin's part) or, offline, the dict given to ``LLM.encode`` (with a
        ``"data"`` key). Raise ``ValueError`` for bad input: the server answers it with a 400."""
        raise NotImplementedError

    @abstractmethod
    def pre_process(self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any) -> Any:
        """The prompt (or sequence of prompts) the model pools: strings, ``TokensPrompt`` dicts, token lists."""
        raise NotImplementedError

    async def pre_process_async(self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any) -> Any:
        return self.pre_process(prompt, request_id, **kwargs)

    def validate_or_generate_params(self, params: Any = None) -> Any:
        """The ``PoolingParams`` the prompts run with; ``params`` is what the caller passed (offline) or None.
        Params without a task run the model's own pooling task (its first of embed, classify, score, ...)."""
        if params is not None:
            return params
        from pagoda.pooling_params import PoolingParams

        return PoolingParams()

    @abstractmethod
    def post_process(self, model_output: Sequence[Any], request_id: str | None = None,
                     **kwargs: Any) -> IOProcessorOutput:
        """Fold the pooled outputs (``PoolingRequestOutput``s, in the order of the prompts) into the plugin's output."""
        raise NotImplementedError

    async def post_process_async(self, model_output: AsyncIterator[tuple[int, Any]], request_id: str | None = None,
                                 **kwargs: Any) -> IOProcessorOutput:
        # outputs arrive in completion order; post_process sees them in prompt order
        collected = sorted([item async for item in model_output], key=lambda item: item[0])
        return self.post_process([out for _, out in collected], request_id, **kwargs)

    @abstractmethod
    def output_to_response(self, plugin_output: IOProcessorOutput) -> IOProcessorResponse:
        raise NotImplementedError


def requested_io_processor(config: EngineConfig, plugin_from_init: str | None = None) -> str | None:
    """The processor's name: the engine argument, else the model config's ``io_processor_plugin`` key."""
    if plugin_from_init:
        return plugin_from_init
    hf_config = config.resolved_model.hf_config if config.resolved_model is not None else None
    name = getattr(hf_config, CONFIG_KEY, None) if hf_config is not None else None
    return str(name) if name else None


def get_io_processor(config: EngineConfig, plugin_from_init: str | None = None) -> IOProcessor[Any, Any] | None:
    """Build the engine's IO processor, or None when none is asked for; a name nobody provides is an error."""
    from pagoda.plugins import get_plugin_manager

    name = requested_io_processor(config, plugin_from_init)
    if name is None:
        return None
    pm = get_plugin_manager()
    specs = pm.io_processors()
    if name not in specs:
        failed = "".join(f" Plugin {i.name} ({i.distribution}) failed to load: {i.error}."
                         for i in pm.failed("io_processor"))
        available = ", ".join(sorted(specs)) or "none"
        source = "io_processor_plugin" if plugin_from_init else f"the model config's {CONFIG_KEY!r}"
        raise PluginError(f"{source} names the IO processor {name!r}, but no installed plugin provides it "
                          f"(installed IO processors: {available}).{failed}")
    cls = specs[name].load()
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        raise PluginError(f"IO processor {name!r} ({specs[name].cls}) is not a pagoda.plugins.io_processors.IOProcessor "
                          "subclass")
    logger.info("IO processor plugin %s (%s) handles plugin requests", name, specs[name].cls)
    processor: IOProcessor[Any, Any] = cls(config)
    return processor
