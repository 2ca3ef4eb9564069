"""Engine configuration as pydantic models.

Every engine argument is declared once, on the section it belongs to
(``ModelConfig``, ``CacheConfig``, ...); ``EngineArgs`` is the flat union of the
sections (it inherits their fields), and the CLI, ``LLM(...)`` and the server all
build their engine from it. Names follow vLLM's. What the user leaves open is
decided in one place, ``pagoda.engine.config_resolution.prepare_engine_config``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from pagoda.pooling.config import ConvertOption, PoolerConfig, RunnerOption
from pagoda.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


class _Config(BaseModel):
    # populate_by_name: a field with a vLLM alias (cache_dtype / kv_cache_dtype) takes both names
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), populate_by_name=True)


DTypeName = Literal["auto", "float32", "float", "bfloat16", "float16", "half"]
# pagoda.attention.kv_quant maps these to torch dtypes
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]


class ModelConfig(_Config):
    model: str | None = Field(None, description="Path to a HF model directory or a .gguf file, or a Hugging Face hub id (org/name, org/name:QUANT for a GGUF repo); None = the embedded default model (SmolLM2-135M-Instruct).")
    tokenizer: str | None = Field(None, description="Tokenizer path or hub id; defaults to the model's.")
    tokenizer_mode: Literal["auto"] = Field("auto", description="vLLM's tokenizer mode: pagoda loads the fast (tokenizers-backed) tokenizer, so only 'auto' is accepted; vLLM's 'slow', 'mistral' and 'custom' are refused.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a model given by hub id; None = main.")
    tokenizer_revision: str | None = Field(None, description="Hub revision of a tokenizer given by hub id; None = main.")
    generation_config: str = Field("auto", description="Default sampling parameters: 'auto' = the model's generation_config.json (or the embedded default model's recommended sampling), 'vllm' = pagoda's own defaults, or a directory holding a generation_config.json.")
    override_generation_config: dict[str, Any] | None = Field(None, description="Values that override the default sampling parameters from generation_config (e.g. {\"temperature\": 0.5}).")
    dtype: DTypeName = Field("auto", description="Weights and activations dtype.")
    quantization: str | None = Field(None, description="Quantization method (vLLM's names: gguf, compressed-tensors, gptq, awq, fp8, ...; each is a plugin, see docs/quantization.md). None = the checkpoint's: config.json's quantization_config.quant_method, or 'gguf' for a GGUF file with quantized tensors (kept in their blocks when pagoda-quant-gguf is installed and the platform runs it). 'none' (pagoda extension) = a GGUF file dequantized to dtype at load.")
    seed: int = Field(0, description="Random seed for sampling.")
    max_model_len: int | None = Field(None, gt=0, description="Context length (prompt + output); defaults to the model's.")
    hf_overrides: dict[str, Any] | None = Field(None, description="Values that override the model's config.json (e.g. architectures).")
    skip_tokenizer_init: bool = Field(False, description="Do not load a tokenizer; prompts must be token ids.")
    trust_remote_code: bool = Field(False, description="Let transformers run the model directory's own Python code (config, tokenizer and, through the transformers fallback, the model: auto_map). Off: such a model is refused.")
    model_impl: Literal["auto", "pagoda", "transformers"] = Field("auto", description="Which implementation serves the model: 'pagoda' = a model-family plugin's own, 'transformers' = the transformers fallback (pagoda-models-transformers) over pagoda's paged attention, 'auto' = the first if a family implements the architecture, else the second.")
    served_model_name: str | None = Field(None, description="Model name the server reports; defaults to the model path.")
    enable_sleep_mode: bool = Field(False, description="Allow sleep(level) / wake_up() (vLLM's): level 1 frees the KV cache, level 2 the weights too (read again from the checkpoint on wake_up); see docs/server.md, \"Sleep mode\".")
    max_logprobs: int = Field(20, ge=0, description="Largest number of logprobs a request may ask for.")
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = Field("raw_logprobs", description="What logprobs report.")
    enforce_eager: bool = Field(False, description="Never capture decode graphs (CUDA graphs on a GPU, kernel graphs on CPU); every step runs eagerly.")
    io_processor_plugin: str | None = Field(None, description="IO processor plugin (pagoda.io_processors group) that turns custom /pooling and LLM.encode requests into prompts and pooled outputs into custom responses; None = the model config's io_processor_plugin key, if any.")
    runner: RunnerOption = Field("auto", description="What the model runs as: 'generate' (sampled tokens), 'pooling' (embeddings, classification, scores: prefill only, a pooler instead of the sampler), 'auto' = the model family's kind, else by the architecture's name as vLLM decides (…ForCausalLM generates, …Model / …ForSequenceClassification pool).")
    convert: ConvertOption = Field("auto", description="Turn a generative model into a pooling one (runner 'pooling'): 'embed' (last token, normalized), 'classify' (a score head on the last token), 'reward' (every token's hidden state), as vLLM's as_embedding_model / as_seq_cls_model / as_reward_model; 'auto' = by the architecture's name; 'none' = no conversion.")
    limit_mm_per_prompt: dict[str, int] | None = Field(None, description="Most multimodal items of each modality in one prompt (vLLM's form: {\"image\": 2}); a modality not named allows 999. A prompt over the limit is refused.")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="Arguments for the multimodal model's processor (transformers' AutoProcessor call) on every prompt; a prompt's own mm_processor_kwargs override them.")
    mm_processor_cache_gb: float = Field(4.0, ge=0, description="GiB of processed multimodal inputs the front end keeps (least recently used dropped first), keyed by the prompt and its images' content hashes; 0 = no cache.")
    allowed_local_media_path: str | None = Field(None, description="Directory whose files chat requests may name as file:// image URLs; None = file:// URLs are refused.")
    allowed_media_domains: list[str] | None = Field(None, description="Hosts chat requests may name in http(s):// image URLs (fetched with a 10 s timeout and a 20 MiB limit); None = http(s) image URLs are refused.")
    pooler_config: PoolerConfig | dict[str, Any] | None = Field(None, description="Overrides of the model's pooler, vLLM's PoolerConfig fields: pooling_type (CLS, MEAN, LAST, ALL, STEP), normalize, dimensions, use_activation, logit_bias, step_tag_id, returned_token_ids.")

    @field_validator("pooler_config", mode="after")
    @classmethod
    def _pooler_config_object(cls, value: Any) -> PoolerConfig | None:
        # a dict (JSON on the CLI) becomes the object, so its fields are checked here
        return PoolerConfig(**value) if isinstance(value, dict) else value


class CacheConfig(_Config):
    block_size: int | None = Field(None, gt=0, description="Tokens per KV cache block; None = the platform's default (16 on GPUs).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    num_kv_blocks: int | None = Field(None, gt=0, description="Override of the computed number of KV cache blocks (vLLM: num_gpu_blocks_override).")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="Absolute KV cache budget in bytes.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of GPU memory the engine may use (GPU platforms).")
    # vLLM's CacheConfig.cache_dtype is its EngineArgs.kv_cache_dtype (the CLI's --kv-cache-dtype): the alias
    cache_dtype: KVCacheDType = Field("auto", validation_alias=AliasChoices("kv_cache_dtype", "cache_dtype"), alias="kv_cache_dtype", description="KV cache dtype (vLLM's --kv-cache-dtype): auto = the model dtype; fp8 (= fp8_e4m3) and fp8_e5m2 store 1 byte per value (twice the tokens of a 16-bit cache in the same budget), scaled by per-layer k_scale / v_scale (1.0 unless calculate_kv_scales).")
    calculate_kv_scales: bool = Field(False, description="fp8 KV cache: derive each layer's k_scale / v_scale from the first step's keys and values (max|k| / 200, max|v| / 100, as vLLM) instead of 1.0.")


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(256, gt=0, description="Most requests in one step.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget of one step; None = a platform default.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="Order of waiting requests.")
    max_num_encoder_input_tokens: int | None = Field(None, gt=0, description="Multimodal encoder budget of one step, in encoder output tokens (an image's placeholder count), beside the token budget; None = max_num_batched_tokens.")
    encoder_cache_size: int | None = Field(None, gt=0, description="Encoder outputs (in placeholder tokens) the engine keeps, so an image is encoded once across its prompt's chunks and a preemption; None = max_num_encoder_input_tokens.")
    cuda_graph_sizes: list[PositiveInt] | None = Field(None, description="Decode batch sizes to capture graphs for; None = the platform's default (GPU: 1, 2, 4, then every 8 up to max_num_seqs, at most 512; CPU: 1, 2, 4, 8, 16, 24, 32 up to max_num_seqs).")


class LoRAConfig(_Config):
    """vLLM's ``LoRAConfig``: built when ``enable_lora`` is set (docs/lora.md)."""

    max_lora_rank: int = Field(16, gt=0, description="Largest rank (r) of an adapter the engine serves; each adapter slot holds this rank, a larger adapter is refused.")
    max_loras: int = Field(1, gt=0, description="Adapter slots: the most distinct adapters in one step (a request whose adapter finds no slot waits).")
    max_cpu_loras: int | None = Field(None, gt=0, description="Adapters kept loaded in host memory (an LRU); None = max_loras. Must be >= max_loras.")
    lora_dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = Field("auto", description="Dtype of the adapter weights in the slots; auto = the model's dtype (a quantized base: its activation dtype).")


class ParallelConfig(_Config):
    tensor_parallel_size: int = Field(1, gt=0, description="Tensor-parallel ranks: each linear layer, the attention heads and the vocabulary split across them.")
    pipeline_parallel_size: int = Field(1, gt=0, description="Pipeline-parallel stages: the decoder layers split into consecutive groups, one per stage, activations passed from stage to stage (one micro-batch in flight).")
    data_parallel_size: int = Field(1, gt=0, description="Engine-core replicas behind one API server, each in its own process with its own copy of the model and KV cache; requests go to the least loaded (pagoda.engine.mp_client).")
    distributed_executor_backend: Literal["uni", "mp", "ray", "external_launcher"] | None = Field(None, description="What runs the workers: 'uni' = in the engine's process, 'mp' = one spawned process per rank on this machine, 'ray' = Ray actors, 'external_launcher' = ranks started by torchrun; None = 'uni' for one rank, else 'mp'.")

    @model_validator(mode="after")
    def _supported_layout(self) -> ParallelConfig:
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; world size {self.world_size} "
                             "(tensor_parallel_size x pipeline_parallel_size) needs 'mp', 'ray' or 'external_launcher'")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs the workers (vLLM's default: in-process for one rank, else mp)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


class DeviceConfig(_Config):
    device: str = Field("auto", description="Platform to run on: auto, cpu, cuda, rocm, tpu (or PAGODA_DEVICE).")
    attention_backend: str | None = Field(None, description="Attention backend by name (or PAGODA_ATTENTION_BACKEND); None = the platform's preference.")


class LoadConfig(_Config):
    load_format: Literal["auto", "safetensors", "pt", "gguf", "dummy"] = Field("auto", description="Weight format.")
    download_dir: str | None = Field(None, description="Hugging Face cache directory that hub ids are looked up in and downloaded to; None = HF_HUB_CACHE / HF_HOME.")


@dataclass(frozen=True)
class ResolvedModel:
    """The model as the engine will run it, decided once while the engine's config is built.

    Front ends read the context length, vocabulary and dtype from here; the
    model runner loads exactly this source, config and dtype.
    """

    source: Any  # pagoda.model_loader.ModelSource
    hf_config: Any  # the whole transformers config (overrides applied)
    text_config: Any  # the decoder's part of it
    dtype: Any  # torch.dtype
    max_model_len: int
    vocab_size: int  # 0 when the config names none (the tokenizer decides)
    # pagoda.model_loader.GenerationDefaults: sampling defaults and extra EOS ids (generation_config)
    generation: Any = None
    # "generate" or "pooling" (pagoda.pooling.resolve); a pooling model's pooler settings and the
    # architecture whose class is built (pagoda.pooling.config.PoolingModelInfo)
    runner_type: str = "generate"
    pooling: Any = None
    # pagoda.quantization.QuantizationConfig, None for float weights
    quant_config: Any = None


def derived_max_model_len(text_config: Any) -> tuple[int | None, str]:
    """-> (the longest context the model's positions cover, what says so), as vLLM derives it: the config's
    position count, times a RoPE scaling factor that stretches it (linear, dynamic, yarn)."""
    positions = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool):
        return None, "no max_position_embeddings"
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    rope_type = (params.get("rope_type") or params.get("type")) if isinstance(params, dict) else None
    factor = params.get("factor") if isinstance(params, dict) else None
    if rope_type in ("linear", "dynamic", "yarn") and isinstance(factor, int | float) and factor > 1:
        base = int(params.get("original_max_position_embeddings") or positions) if rope_type == "yarn" else positions
        return max(positions, int(base * factor)), f"max_position_embeddings={positions}, {rope_type} RoPE x{factor:g}"
    return positions, f"max_position_embeddings={positions} in the model's config"


def check_max_model_len(max_model_len: int, text_config: Any) -> None:
    """Refuse a max_model_len past the model's positions (vLLM's rule): a prompt reaching past them fails
    inside the forward pass, or reads positions the model never learned. PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1
    (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) allows it; RoPE's table then grows to max_model_len."""
    from pagoda import envs

    derived, origin = derived_max_model_len(text_config)
    if derived is None or max_model_len <= derived:
        return
    if not envs.PAGODA_ALLOW_LONG_MAX_MODEL_LEN:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than this model's {derived} positions ({origin}). "
            "Set it to at most that, or set PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway (outputs past "
            "the model's positions may be meaningless).")
    logger.warning("max_model_len=%d is longer than this model's %d positions (%s); allowed by "
                   "PAGODA_ALLOW_LONG_MAX_MODEL_LEN: outputs past them may be meaningless",
                   max_model_len, derived, origin)
    if derived == getattr(text_config, "max_position_embeddings", None):
        # RoPE's cos/sin table is sized by max_position_embeddings: grow it so long prompts index it
        text_config.max_position_embeddings = max_model_len


def resolve_model(model: ModelConfig, platform: Any, download_dir: str | None = None) -> ResolvedModel:
    """Find the checkpoint, read its config, and fix dtype (the platform's choice) and context length."""
    from pagoda.model_loader import checkpoint_dtype, load_generation_defaults, load_model_config, resolve_model_path
    from pagoda.models.interface import config_for

    source = resolve_model_path(model.model, model.revision, download_dir)
    hf_config = load_model_config(source, model.hf_overrides, model.trust_remote_code)
    text_config = config_for(hf_config)
    from pagoda.pooling.resolve import resolve_runner

    generation = load_generation_defaults(source, model.generation_config, model.override_generation_config)
    logger.info("%s", generation.describe())
    runner = resolve_runner(model, source, hf_config)
    max_model_len = model.max_model_len or runner.max_model_len or int(getattr(text_config, "max_position_embeddings", 2048))
    if runner.max_model_len is not None and max_model_len > runner.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} is longer than this model takes ({runner.max_model_len} "
                         f"tokens: {runner.max_model_len_origin})")
    if model.max_model_len is not None:
        check_max_model_len(model.max_model_len, text_config)
    from pagoda.quantization import resolve_quantization

    dtype = platform.resolve_dtype(model.dtype, checkpoint_dtype(source))
    # Not described here: a method's description may name its kernels, which this (API) process would
    # then build for nothing; the model runner logs it when it loads the weights.
    quant_config = resolve_quantization(model.quantization, source, hf_config, platform, dtype)
    return ResolvedModel(
        source=source,
        hf_config=hf_config,
        text_config=text_config,
        dtype=dtype,
        quant_config=quant_config,
        max_model_len=max_model_len,
        vocab_size=int(getattr(text_config, "vocab_size", 0) or 0),
        generation=generation,
        runner_type=runner.runner_type,
        pooling=runner.pooling,
    )


class StructuredOutputsConfig(_Config):
    """vLLM's ``StructuredOutputsConfig`` (``--structured-outputs-config '{"backend": "xgrammar"}'``)."""

    backend: str = Field("auto", description="Structured outputs backend: a plugin's name in the pagoda.structured_output_backends group (xgrammar, guidance), or 'auto' = per request, xgrammar when it supports the constraint, else guidance.")
    reasoning_parser: str = Field("", description="Reasoning parser (a pagoda.reasoning_parsers plugin's name: deepseek_r1, qwen3): structured outputs constrain only the answer after the reasoning ends, and the server splits reasoning_content from content.")
    enable_in_reasoning: bool = Field(False, description="Constrain the reasoning too (the grammar applies from the first output token even with a reasoning parser).")
    # pagoda's bounds (vLLM has none; docs/server.md, "Limits"): checked in the front end, a 400 naming them
    max_schema_properties: int = Field(400, ge=0, description="Most properties one JSON schema object may declare; compile time grows steeply with them (xgrammar: 400 took 0.36 s, 1,000 17 s). 0 = unbounded.")
    max_schema_nodes: int = Field(20_000, ge=0, description="Most values (objects, arrays, scalars) one JSON schema may hold. 0 = unbounded.")
    max_constraint_chars: int = Field(100_000, ge=0, description="Longest regex, grammar, choice list, structural tag or JSON schema text, in characters. 0 = unbounded.")
    compile_timeout: float = Field(60.0, ge=0, description="Seconds a grammar may take to compile (a 400 naming this limit after that); a backend that compiles in a worker process (xgrammar) has the compile killed, one that cannot (guidance, which compiles lazily) only fails the waiting requests. 0 = unbounded.")
    compile_memory_bytes: int = Field(2 * 1024 ** 3, ge=0, description="Address space one grammar compile may take beyond its worker process's own (RLIMIT_AS; over it, a 400 naming this limit), for backends that compile in a worker process. 0 = unbounded.")
    compile_in_subprocess: bool = Field(True, description="Compile grammars in worker processes where the backend can (xgrammar), so that compile_timeout and compile_memory_bytes stop them; False = in threads of the engine core.")
    grammar_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="Bytes of compiled grammars kept for reuse (least recently used dropped first; a grammar in use stays).")


def _default_structured_outputs_config() -> StructuredOutputsConfig:
    return StructuredOutputsConfig(backend="auto", reasoning_parser="", enable_in_reasoning=False)


class EngineConfig(_Config):
    """Everything an engine (and each of its worker processes) needs; picklable.

    Built by ``EngineArgs.create_engine_config`` with what the user gave (None = not given),
    then resolved in place, once, by ``pagoda.engine.config_resolution.prepare_engine_config``.
    """

    model_config_: ModelConfig = Field(alias="model_config")
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    structured_outputs_config: StructuredOutputsConfig = Field(default_factory=_default_structured_outputs_config)
    # None: LoRA is off (vLLM's EngineConfig.lora_config); resolved by prepare_engine_config
    lora_config: LoRAConfig | None = None
    # None: no speculative decoding
    speculative_config: SpeculativeConfig | None = None
    # Decided once in the main process and replayed in workers.
    plugins: list[str] | None = None
    registered_models: dict[str, str] = Field(default_factory=dict)
    # Set by prepare_engine_config: where each value it decided came from ("section.field" -> source).
    sources: dict[str, str] = Field(default_factory=dict)
    # Set by prepare_engine_config once the platform is known.
    resolved_model: ResolvedModel | None = Field(None, exclude=True)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), populate_by_name=True)

    @property
    def model(self) -> ModelConfig:
        return self.model_config_

    @property
    def resolved(self) -> ResolvedModel:
        if self.resolved_model is None:
            raise RuntimeError("the model is not resolved yet: build the engine config with prepare_engine_config")
        return self.resolved_model

    @property
    def block_size(self) -> int:
        """The KV cache block size the engine runs with (the user's or the platform's)."""
        return self._resolved_value(self.cache_config.block_size, "block_size")

    @property
    def max_num_batched_tokens(self) -> int:
        """The step budget the engine runs with (the user's, the platform's or the engine's rule)."""
        return self._resolved_value(self.scheduler_config.max_num_batched_tokens, "max_num_batched_tokens")

    def _resolved_value(self, value: int | None, name: str) -> int:
        if value is None:
            raise RuntimeError(f"{name} is not resolved yet: build the engine config with prepare_engine_config")
        return value


_SECTIONS: dict[str, type[_Config]] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "device_config": DeviceConfig,
    "load_config": LoadConfig,
}


def _vllm_none_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's None-means-default values.

    Libraries written for vLLM pass every argument they know (lm-eval: ``max_num_seqs=None``);
    None there means "not given", so the default and its source stay.
    """
    data = dict(data)
    if "max_num_seqs" in data and data["max_num_seqs"] is None:
        del data["max_num_seqs"]
    return data


# Bases in reverse so that pydantic, which takes the fields of the last base first, lists them
# in section order (model, cache, scheduler, parallel, device, load): the CLI's --help order.
class EngineArgs(LoRAConfig, LoadConfig, DeviceConfig, ParallelConfig, SchedulerConfig, CacheConfig, ModelConfig):
    """The flat list of engine arguments (what ``LLM(...)`` and the CLI take).

    Every section field is inherited, never re-declared: a field added to a section is an
    engine argument, a CLI option and an ``LLM(...)`` keyword at once.
    """

    enable_lora: bool = Field(False, description="Serve LoRA adapters (PEFT format) beside the base model: requests name one with lora_request (offline) or model (server); see docs/lora.md.")
    # vLLM's flat --reasoning-parser; lands in structured_outputs_config.reasoning_parser.
    reasoning_parser: str = Field("", description=StructuredOutputsConfig.model_fields["reasoning_parser"].description)
    # A whole section (as in vLLM), not flattened: --structured-outputs-config takes JSON.
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | None = Field(
        default_factory=_default_structured_outputs_config, description=StructuredOutputsConfig.__doc__)

    # A whole section too (vLLM's --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}').
    speculative_config: SpeculativeConfig | dict[str, Any] | None = Field(None, description=SpeculativeConfig.__doc__)

    @field_validator("speculative_config", mode="after")
    @classmethod
    def _speculative_config_object(cls, value: Any) -> SpeculativeConfig | None:
        return SpeculativeConfig(**value) if isinstance(value, dict) else value

    @field_validator("structured_outputs_config", mode="after")
    @classmethod
    def _structured_outputs_config_object(cls, value: Any) -> StructuredOutputsConfig:
        if value is None:
            return _default_structured_outputs_config()
        return StructuredOutputsConfig(**value) if isinstance(value, dict) else value

    @property
    def kv_cache_dtype(self) -> KVCacheDType:
        """vLLM's EngineArgs name for ``cache_dtype`` (the CLI's --kv-cache-dtype)."""
        return self.cache_dtype

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, value: KVCacheDType) -> None:
        self.cache_dtype = value

    @model_validator(mode="before")
    @classmethod
    def _vllm_aliases(cls, data: Any) -> Any:
        # vLLM's name for the block-count override.
        if isinstance(data, dict) and "num_gpu_blocks_override" in data:
            data = dict(data)
            value = data.pop("num_gpu_blocks_override")
            data.setdefault("num_kv_blocks", value)
        if isinstance(data, dict):
            data = _vllm_none_defaults(data)
        return data

    def create_engine_config(self) -> EngineConfig:
        """The sections, each given exactly the fields the user set (so each knows what was given)."""
        given = self.model_fields_set
        sections: dict[str, Any] = {
            key: section(**{name: getattr(self, name) for name in section.model_fields if name in given})
            for key, section in _SECTIONS.items()
        }
        structured = self._structured_outputs_config_object(self.structured_outputs_config)
        if self.reasoning_parser:
            if structured.reasoning_parser and structured.reasoning_parser != self.reasoning_parser:
                raise ValueError(f"reasoning_parser={self.reasoning_parser!r} and structured_outputs_config."
                                 f"reasoning_parser={structured.reasoning_parser!r} disagree; set one")
            structured = structured.model_copy(update={"reasoning_parser": self.reasoning_parser})
        lora_fields = {name: getattr(self, name) for name in LoRAConfig.model_fields if name in given}
        # (the CLI passes every option, its defaults too: only a value other than the default asks for LoRA)
        asked = sorted(n for n, v in lora_fields.items() if v != LoRAConfig.model_fields[n].get_default())
        if asked and not self.enable_lora:
            raise ValueError(f"{', '.join(asked)} configure LoRA adapters: pass enable_lora=True too")
        lora = LoRAConfig(**lora_fields) if self.enable_lora else None
        return EngineConfig(**sections, structured_outputs_config=structured, lora_config=lora,
                            speculative_config=self._speculative_config_object(self.speculative_config))


class AsyncEngineArgs(EngineArgs):
    """Same fields as EngineArgs (vLLM keeps both names)."""
