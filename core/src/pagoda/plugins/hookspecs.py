"""Hook specifications: the contract between core and its plugins.

A plugin is a module (or object) whose functions are named after these hooks and
marked ``@pagoda.plugins.hookimpl``; it declares ``PAGODA_PLUGIN_API_VERSION``
(the API version whose hooks it uses) and is found through an entry point of its
kind (``pagoda.plugins.ENTRY_POINT_GROUPS``). pluggy passes an implementation only
the arguments it names, so adding an argument to a hookspec later never breaks
an old plugin.

Two kinds of hooks:

- **Registration hooks** (``pagoda_register_*``) take no arguments and return a
  list of small frozen spec objects (``pagoda.plugins.specs``) that name the
  heavy code by a ``"module:Attr"`` string, imported only when chosen. The
  plugin manager calls every registration hook, one plugin at a time, the first
  time any registry is asked for (``PluginManager.platforms()`` etc.), freezes
  the results, and calls them again only after another plugin registers: keep
  them pure and cheap. Each docstring's "Read when" says when core looks a spec
  up. No hook runs on the per-step path. A wrapper implementation of one is refused.
- **Historic hooks** (``pagoda_add_env_vars``, ``pagoda_startup``) are called
  with ``call_historic``: a plugin registered after the call (a late
  ``PluginManager.register`` from a script or test) is called with the same
  arguments when it registers, as pytest calls a late plugin's
  ``pytest_addoption``. They return nothing.

Each hook's docstring says its arguments, what it returns, when it is called,
and shows an implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pagoda.envs import EnvRegistry
    from pagoda.plugins.specs import (
        AttentionBackendSpec,
        IOProcessorSpec,
        LogitsProcessorSpec,
        LoRAResolverSpec,
        ModelFallbackSpec,
        ModelSpec,
        PlatformSpec,
        QuantizationSpec,
        ReasoningParserSpec,
        SpecProposerSpec,
        StructuredOutputBackendSpec,
        ToolParserSpec,
    )

PROJECT_NAME = "pagoda"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pagoda_register_platforms() -> list[PlatformSpec]:
    """Hardware platforms this plugin provides.

    :return: one ``PlatformSpec`` per platform: ``name`` (what ``--device`` and
        ``PAGODA_DEVICE`` take), ``cls`` (``"module:Class"`` of a
        ``pagoda.platforms.Platform`` subclass), ``device_type``, ``package``
        (the distribution named in install hints), ``priority`` (the highest
        available one wins ``--device auto``), ``verified_on_hardware``.

    Read when a platform is resolved (``pagoda.platforms.resolve_platform``,
    ``pagoda plugins list``); the class is imported only then, to run its ``probe``.

    Example::

        @hookimpl
        def pagoda_register_platforms() -> list[PlatformSpec]:
            return [PlatformSpec(name="npu", cls="my_npu.platform:NpuPlatform",
                                 device_type="npu", package="my-npu", priority=5)]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_model_families() -> list[ModelSpec]:
    """Model architectures this plugin implements.

    :return: one ``ModelSpec`` per architecture: ``architecture`` (a name of a
        HF ``config.json``'s ``architectures`` list), ``cls`` (``"module:Class"``
        of the model), ``runner`` (``"generate"``, or ``"pooling"`` for a model
        with its own pooler).

    Read when a model is resolved or loaded (``pagoda.models.registry.ModelRegistry``),
    in the main process and in each worker; the class is imported only for the
    architecture being loaded.

    Example::

        @hookimpl
        def pagoda_register_model_families() -> list[ModelSpec]:
            return [ModelSpec(architecture="MyForCausalLM", cls="my_models.my:MyForCausalLM")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_model_fallbacks() -> list[ModelFallbackSpec]:
    """Generic model implementations for architectures no family implements (plugin API 1.1).

    :return: ``ModelFallbackSpec`` records: ``name`` (``"transformers"`` is the
        one ``model_impl="transformers"`` asks for), ``cls`` (built as
        ``cls(hf_config, dtype, trust_remote_code=...)``), ``check``
        (``"module:function"`` returning the reasons it cannot serve a config),
        ``description``.

    Read when a model is resolved: ``model_impl="auto"`` uses the first
    fallback whose ``check`` finds no reason when no family implements the
    architecture.

    Example::

        @hookimpl
        def pagoda_register_model_fallbacks() -> list[ModelFallbackSpec]:
            return [ModelFallbackSpec(name="transformers", cls="my_fallback.model:Generic",
                                      check="my_fallback.model:reasons_against")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
    """Attention backends this plugin provides.

    :return: ``AttentionBackendSpec`` records: ``name`` (what ``--attention-backend``
        and the platform's preference list name), ``cls`` (``"module:Class"`` of a
        ``pagoda.attention.interface.AttentionBackend`` subclass), ``device_types``.

    Read when the model runner selects its backend (``pagoda.attention.selector``),
    in each worker; only the chosen class is imported.

    Example::

        @hookimpl
        def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
            return [AttentionBackendSpec(name="my_paged", cls="my_attn.backend:MyBackend",
                                         device_types=("cpu",))]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
    """Quantization methods this plugin provides.

    :return: ``QuantizationSpec`` records: ``name`` (vLLM's method name, what
        ``--quantization`` and a checkpoint's ``quant_method`` say), ``cls``
        (``"module:Class"`` of a ``pagoda.quantization.QuantizationConfig``).

    Read when the engine config is resolved and the checkpoint names a method
    (``pagoda.quantization.resolve_quantization``); the class is imported then.

    Example::

        @hookimpl
        def pagoda_register_quantization_methods() -> list[QuantizationSpec]:
            return [QuantizationSpec(name="myq", cls="my_quant.config:MyQuantConfig")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_lora_resolvers() -> list[LoRAResolverSpec]:
    """LoRA resolvers this plugin provides (plugin API 1.6; vLLM's ``LoRAResolver``).

    :return: ``LoRAResolverSpec`` records: ``name``, ``cls`` (``"module:Class"`` of a
        ``pagoda.lora.resolver.LoRAResolver`` subclass, built with no arguments).

    Read by the server when a request's ``model`` names no loaded adapter and
    ``PAGODA_ALLOW_RUNTIME_LORA_UPDATING`` is set: each resolver is asked in turn.

    Example::

        @hookimpl
        def pagoda_register_lora_resolvers() -> list[LoRAResolverSpec]:
            return [LoRAResolverSpec(name="s3", cls="my_resolvers.s3:S3Resolver")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_io_processors() -> list[IOProcessorSpec]:
    """Input/output processors for pooling models.

    :return: ``IOProcessorSpec`` records: ``name`` (what ``--io-processor-plugin``
        takes), ``cls`` (``"module:Class"`` of a ``pagoda.plugins.io_processors.IOProcessor``).

    Read when an engine or server starts with ``io_processor_plugin`` set (or a
    model config that names one).

    Example::

        @hookimpl
        def pagoda_register_io_processors() -> list[IOProcessorSpec]:
            return [IOProcessorSpec(name="chunked", cls="my_io.processor:ChunkedProcessor")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_logits_processors() -> list[LogitsProcessorSpec]:
    """Logits processors that requests may name.

    :return: ``LogitsProcessorSpec`` records: ``name`` (what a request's
        ``logits_processors`` lists), ``cls`` (``"module:Class"``).

    Read when a request's named logits processor is resolved
    (``pagoda.engine.logits_processors.NamedLogitsProcessor``).

    Example::

        @hookimpl
        def pagoda_register_logits_processors() -> list[LogitsProcessorSpec]:
            return [LogitsProcessorSpec(name="no_digits", cls="my_lp.processors:NoDigits")]
    """
    raise NotImplementedError


@hookspec(historic=True)
def pagoda_add_env_vars(registry: EnvRegistry) -> None:
    """Declare this plugin's ``PAGODA_*`` environment variables (plugin API 1.5).

    :param registry: ``pagoda.envs.REGISTRY``; call ``registry.add(*variables)``
        with ``pagoda.envs.EnvVar`` records (name, type, default, help, the
        distribution that reads it, a parser such as ``pagoda.envs.parse_bool``).
        Declaring a name another distribution declared differently is an error.
    :return: nothing.

    Historic: called when the plugin registers, in every process that loads
    plugins (the API process, the engine-core process, each worker), so
    ``pagoda.envs.<NAME>`` reads the variable there, ``pagoda collect-env``
    checks it, and docs/environment.md must list it.

    Example::

        from pagoda.envs import EnvVar, parse_bool

        MY_KERNEL = EnvVar("PAGODA_MY_KERNEL", "bool", True,
                           "Off: the torch reference instead of the C++ kernel.", "my-plugin", parse_bool)

        @hookimpl
        def pagoda_add_env_vars(registry: EnvRegistry) -> None:
            registry.add(MY_KERNEL)
    """


@hookspec(historic=True)
def pagoda_startup(config: Any) -> None:
    """An engine is starting (general plugins: patches, environment set-up, early builds).

    :param config: the ``pagoda.config.EngineConfig`` being resolved: plugins
        and platform decided, the user's values in place, the platform's defaults
        not yet applied (``pagoda.engine.config_resolution`` decides those after
        this hook). A plugin that needs the model early may set
        ``config.resolved_model = pagoda.config.resolve_model(...)``, which the
        resolution then keeps (pagoda-attn-cpu does, to start its kernel build);
        other fields are read, not changed.
    :return: nothing.

    Called by ``prepare_engine_config`` in the main process, once per engine
    built there. Historic: a plugin registered later in the same process is
    called at registration with the config of each engine started before it.

    Example::

        @hookimpl
        def pagoda_startup(config: Any) -> None:
            if config.device_config.device in ("auto", "cpu"):
                start_compiling_my_kernel()  # runs while the weights load
    """


@hookspec
def pagoda_register_structured_output_backends() -> list[StructuredOutputBackendSpec]:
    """Structured-outputs backends: grammar compilers and matchers (plugin API 1.2).

    :return: ``StructuredOutputBackendSpec`` records: ``name`` (what
        ``--structured-outputs-config '{"backend": NAME}'`` takes), ``cls``
        (``"module:Class"`` of a ``pagoda.structured_output.StructuredOutputBackend``).

    Read on the first request with a constraint (``pagoda.structured_output.manager``);
    the class is imported then.

    Example::

        @hookimpl
        def pagoda_register_structured_output_backends() -> list[StructuredOutputBackendSpec]:
            return [StructuredOutputBackendSpec(name="mygrammar", cls="my_so.backend:MyBackend")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_tool_parsers() -> list[ToolParserSpec]:
    """Tool-call parsers for ``tool_choice="auto"`` (plugin API 1.3).

    :return: ``ToolParserSpec`` records: ``name`` (what ``--tool-call-parser``
        takes), ``cls`` (``"module:Class"`` of a
        ``pagoda.entrypoints.openai.tool_parsers.ToolParser``).

    Read when the server starts with ``--tool-call-parser``; the class is
    imported then.

    Example::

        @hookimpl
        def pagoda_register_tool_parsers() -> list[ToolParserSpec]:
            return [ToolParserSpec(name="my_format", cls="my_tools.parser:MyToolParser")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_reasoning_parsers() -> list[ReasoningParserSpec]:
    """Reasoning parsers that split thinking from the answer (plugin API 1.4).

    :return: ``ReasoningParserSpec`` records: ``name`` (what ``--reasoning-parser``
        takes), ``cls`` (``"module:Class"`` of a ``pagoda.reasoning.ReasoningParser``).

    Read when an engine or server starts with a reasoning parser; the class is
    imported then.

    Example::

        @hookimpl
        def pagoda_register_reasoning_parsers() -> list[ReasoningParserSpec]:
            return [ReasoningParserSpec(name="my_think", cls="my_reasoning.parser:MyThinkParser")]
    """
    raise NotImplementedError


@hookspec
def pagoda_register_spec_proposers() -> list[SpecProposerSpec]:
    """Speculative decoding proposers (plugin API 1.6).

    :return: ``SpecProposerSpec`` records: ``name`` (what ``speculative_config={"method": NAME}``
        takes), ``cls`` (``"module:Class"`` of a ``pagoda.spec_decode.Proposer``).

    Read when an engine starts with a ``speculative_config``; the class is imported then.

    Example::

        @hookimpl
        def pagoda_register_spec_proposers() -> list[SpecProposerSpec]:
            return [SpecProposerSpec(name="my_lookup", cls="my_spec.proposer:MyProposer")]
    """
    raise NotImplementedError
