"""The one place an engine's configuration is decided: the user's arguments, then the platform's defaults.

``prepare_engine_config`` runs once, in the main process, before any worker or
engine-core process exists; they receive the resolved config pickled and only
replay it (``pagoda.worker.process``). Every value the engine runs with is
decided here, each with one default and one source, and the start-up log states
them all once:

- ``user``: given in ``LLM(...)``, ``EngineArgs`` or on the command line;
- ``default``: the field's own default (``pagoda.config``);
- ``platform default``: ``Platform.config_defaults`` (a ``PlatformDefaults`` record);
- ``model config``: read from the checkpoint (context length, dtype);
- ``derived``: computed from other resolved values (a pooling model's step budget, ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineConfig, resolve_model
from pagoda.models.registry import ModelRegistry
from pagoda.platforms import Platform, PlatformDefaults, resolve_platform, set_current_platform
from pagoda.plugins import get_plugin_manager

logger = logging.getLogger(__name__)

# The step budget when neither the user nor the platform sets one. On CPU a bigger chunk buys
# nothing (compute-bound) and delays decodes; without chunked prefill the budget must still hold a
# whole prompt, so it is then at least the context length.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# A pooling model's step budget when the user sets none (the platform's is sized for decodes beside
# prefill chunks: 512 on CPU). all-MiniLM-L6-v2, 128 x 64-token sentences, 1 thread: 2048 -> 4.3 s,
# 8192 -> 5.2 s (the CPU GEMM is at its best up to ~2K rows; larger steps only add cache misses).
POOLING_MAX_NUM_BATCHED_TOKENS = 2048

USER, DEFAULT, PLATFORM, MODEL, DERIVED = "user", "default", "platform default", "model config", "derived"
# how the start-up block names a value the engine-core process decides (resolve_in_engine_core)
ENGINE_CORE_DECIDES = "decided in the engine core"


@dataclass
class _Sources:
    """Where each resolved value came from, keyed ``section.field``."""

    config: EngineConfig
    by_field: dict[str, str] = field(default_factory=dict)

    def given(self, section: str, name: str) -> bool:
        """Whether the user set ``section.name`` (a None default counts as not set)."""
        obj = _section(self.config, section)
        return name in obj.model_fields_set and getattr(obj, name) is not None

    def set(self, section: str, name: str, value: Any, source: str) -> None:
        setattr(_section(self.config, section), name, value)
        self.by_field[f"{section}.{name}"] = source


_SECTION_NAMES = ("model_config", "cache_config", "scheduler_config", "parallel_config", "device_config",
                  "load_config", "structured_outputs_config", "lora_config")


def _section(config: EngineConfig, name: str) -> Any:
    # config.model_config is pydantic's own settings dict; the model section is config.model
    return config.model if name == "model_config" else getattr(config, name)


def prepare_engine_config(config: EngineConfig) -> Platform:
    """Resolve ``config`` in place, once, and return the platform it runs on.

    Decides the plugins, the in-script models and the platform; asks the platform for its
    defaults; resolves the model (path, HF config, dtype, context length); then fills every value
    the user left open (block size, step budget, chunked prefill, graph sizes) and logs the lot.
    """
    pm = get_plugin_manager()
    config.plugins = pm.loaded_names()
    config.registered_models = ModelRegistry.registered_in_script()
    platform = resolve_platform(config.device_config.device)
    set_current_platform(platform)
    defaults = platform.config_defaults(config)
    pm.startup(config)
    if config.resolved_model is None:
        config.resolved_model = resolve_model(config.model, platform, config.load_config.download_dir)
    apply_defaults(config, platform, defaults)
    logger.info("%s", describe_engine_config(config, platform, defaults))
    return platform


def apply_defaults(config: EngineConfig, platform: Platform, defaults: PlatformDefaults) -> None:
    """Fill what the user left open in a config whose model is resolved, and record each value's source.

    The user's values win; then the platform's ``defaults``; then the engine's rules (a pooling
    model's, the step budget's). Raises where the result cannot run.
    """
    sources = _Sources(config)
    _resolve_cache(sources, defaults)
    _resolve_schedule(sources, defaults, platform.name)
    _resolve_graphs(sources, defaults, platform)
    _resolve_lora(sources)
    _check_speculative(config)
    config.sources = sources.by_field


def _check_speculative(config: EngineConfig) -> None:
    """Speculative decoding's refusals, as vLLM's: no pipeline parallelism, no pooling model."""
    if config.speculative_config is None:
        return
    if config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("speculative decoding (speculative_config) does not run with pipeline parallelism; "
                         "set pipeline_parallel_size=1 or drop speculative_config")
    if config.resolved.runner_type != "generate":
        raise ValueError("speculative decoding (speculative_config) applies to generative models; "
                         f"this model runs as {config.resolved.runner_type!r}")


def _resolve_cache(sources: _Sources, defaults: PlatformDefaults) -> None:
    if not sources.given("cache_config", "block_size"):
        sources.set("cache_config", "block_size", defaults.block_size, PLATFORM)
    if sources.config.resolved.runner_type == "pooling" and sources.config.cache_config.enable_prefix_caching:
        # a cached prefix would leave its hidden states uncomputed, and the poolers read every position's
        sources.set("cache_config", "enable_prefix_caching", False, f"{DERIVED}: a pooling model")


def _resolve_schedule(sources: _Sources, defaults: PlatformDefaults, platform_name: str) -> None:
    """Chunked prefill, then the step budget that depends on it."""
    config = sources.config
    sc = config.scheduler_config
    max_model_len = config.resolved.max_model_len
    pooling = config.resolved.runner_type == "pooling"
    if pooling and sc.enable_chunked_prefill:
        # vLLM's rule: a prompt is pooled whole in one step (bidirectional attention needs all of it)
        sources.set("scheduler_config", "enable_chunked_prefill", False, f"{DERIVED}: a pooling model")
    elif defaults.requires_chunked_prefill and not sc.enable_chunked_prefill:
        sources.set("scheduler_config", "enable_chunked_prefill", True, f"{PLATFORM}: required by {platform_name}")
    if sources.given("scheduler_config", "max_num_batched_tokens"):
        pass
    elif defaults.max_num_batched_tokens_in_engine_core and sc.enable_chunked_prefill and not pooling:
        # measured where the kernels run (resolve_in_engine_core); the start-up block says so. Chunked
        # prefill is on, so whatever budget comes runs: nothing to check here.
        sources.set("scheduler_config", "max_num_batched_tokens", None,
                    f"{PLATFORM}: {ENGINE_CORE_DECIDES} ({defaults.max_num_batched_tokens_source or 'measured'})")
        return
    else:
        if pooling:
            # pooling steps are all prefill: the platform's budget (sized for decodes beside chunks) is dropped
            budget, source = max(POOLING_MAX_NUM_BATCHED_TOKENS, max_model_len), f"{DERIVED}: a pooling model"
        elif defaults.max_num_batched_tokens is not None:
            budget = defaults.max_num_batched_tokens
            source = f"{PLATFORM}{': ' + defaults.max_num_batched_tokens_source if defaults.max_num_batched_tokens_source else ''}"
        elif sc.enable_chunked_prefill:
            budget, source = DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT
        else:
            budget, source = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len), f"{DERIVED}: a whole prompt per step"
        sources.set("scheduler_config", "max_num_batched_tokens", budget, source)
    budget = config.max_num_batched_tokens
    if not sc.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}: "
            "without chunked prefill a whole prompt must fit in one step"
        )


def resolve_in_engine_core(config: EngineConfig, platform: Platform) -> None:
    """Decide, in the engine-core process, what ``prepare_engine_config`` left to it, and log each value.

    The step budget, where the platform measures it on the kernels this process runs
    (``PlatformDefaults.max_num_batched_tokens_in_engine_core``); the API process logged it as
    ``None (platform default: decided in the engine core ...)``. Idempotent: a resolved value stays.
    """
    key = "scheduler_config.max_num_batched_tokens"
    sc = config.scheduler_config
    source = config.sources.get(key, "")
    if sc.max_num_batched_tokens is not None or ENGINE_CORE_DECIDES not in source:
        return
    sc.max_num_batched_tokens = platform.engine_core_step_budget(config)
    config.sources[key] = source
    logger.info("%s = %d (%s)", key, sc.max_num_batched_tokens, source)


def _resolve_graphs(sources: _Sources, defaults: PlatformDefaults, platform: Platform) -> None:
    """The decode batch sizes graphs are captured for: [] runs every step eagerly."""
    config = sources.config
    max_num_seqs = config.scheduler_config.max_num_seqs
    given = config.scheduler_config.cuda_graph_sizes if sources.given("scheduler_config", "cuda_graph_sizes") else None
    if config.model.enforce_eager:
        sizes, source = [], f"{USER}: enforce_eager"
    elif config.lora_config is not None:
        # the adapter slots and per-token slot index are static buffers, but no graph path is verified with them yet
        sizes, source = [], f"{DERIVED}: enable_lora (LoRA steps run eagerly)"
    elif not (platform.supports_graphs and defaults.graphs):
        sizes, source = [], f"{PLATFORM}: {defaults.graphs_off_reason or f'no decode graphs on {platform.name}'}"
    elif given is not None:
        # a graph larger than the largest possible decode batch would never be replayed
        sizes, source = sorted({s for s in given if s <= max_num_seqs}), USER
    else:
        sizes, source = sorted({s for s in defaults.graph_sizes if s <= max_num_seqs}), PLATFORM
    sources.set("scheduler_config", "cuda_graph_sizes", sizes, source)


def _resolve_lora(sources: _Sources) -> None:
    """``max_cpu_loras`` (None = ``max_loras``)."""
    config = sources.config
    lora = config.lora_config
    if lora is None:
        return
    if lora.max_cpu_loras is None:
        sources.set("lora_config", "max_cpu_loras", lora.max_loras, f"{DERIVED}: max_loras")
    elif lora.max_cpu_loras < lora.max_loras:
        raise ValueError(f"max_cpu_loras={lora.max_cpu_loras} must be >= max_loras={lora.max_loras} (every adapter in a "
                         "slot is also held in host memory)")


# the model fields whose resolved value (resolved.*) the block states instead of what was asked
_STATED_RESOLVED = frozenset({"model_config.dtype", "model_config.max_model_len", "model_config.runner",
                              "model_config.quantization"})


def describe_engine_config(config: EngineConfig, platform: Platform, defaults: PlatformDefaults) -> str:
    """The start-up log's one block: every value the engine runs with, by section, with its source."""
    model = config.resolved
    lines = [f"engine config (platform {platform.name}):"]
    for section in _SECTION_NAMES:
        obj = _section(config, section)
        if obj is None:  # lora_config without enable_lora
            continue
        for name in type(obj).model_fields:
            key = f"{section}.{name}"
            if key in _STATED_RESOLVED:
                continue
            value = getattr(obj, name)
            lines.append(f"  {key} = {value!r} ({config.sources.get(key) or _given_or_default(obj, name, value)})")
    dtype_source = USER if config.model.dtype != "auto" else f"{PLATFORM} for the checkpoint's dtype (dtype=auto)"
    context_source = USER if config.model.max_model_len is not None else MODEL
    lines += [
        f"  resolved.dtype = {str(model.dtype).removeprefix('torch.')} ({dtype_source})",
        f"  resolved.max_model_len = {model.max_model_len} ({context_source})",
        f"  resolved.runner_type = {model.runner_type} ({USER if config.model.runner != 'auto' else MODEL})",
        f"  resolved.quantization = {model.quant_config.get_name() if model.quant_config is not None else None} "
        f"({USER if config.model.quantization is not None else MODEL})",
        f"  kv cache budget = {_kv_budget(config, defaults)}",
    ]
    return "\n".join(lines)


def _given_or_default(obj: Any, name: str, value: Any) -> str:
    # a value passed explicitly but equal to the field's default (LLM(model=None)) is the default
    field_info = type(obj).model_fields[name]
    default = field_info.get_default(call_default_factory=True)
    return USER if name in obj.model_fields_set and value != default else DEFAULT


def _kv_budget(config: EngineConfig, defaults: PlatformDefaults) -> str:
    cc = config.cache_config
    if cc.kv_cache_memory_bytes is not None:
        return f"{cc.kv_cache_memory_bytes} bytes ({USER}: kv_cache_memory_bytes)"
    return f"{defaults.kv_cache_budget_rule or 'the platform rule'} ({PLATFORM})"
