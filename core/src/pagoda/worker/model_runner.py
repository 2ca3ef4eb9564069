"""Runs the model on a flat batch. A step is a short pipeline (``execute_model``): apply the scheduler's
diffs to the persistent batch -> prepare the flat inputs (``pagoda.worker.step_inputs``) -> forward (a
captured graph or eager) -> on the last stage, the output head chosen at load (``pagoda.worker.output_heads``:
logits at the rows that sample and the sampler's stages, or the pooler)."""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.attention import Attention, AttentionMetadata, AttentionSpec
from pagoda.attention.kv_quant import is_fp8, resolve_kv_cache_dtype
from pagoda.attention.selector import select_attention_backend
from pagoda.config import EngineConfig
from pagoda.distributed import get_pp_group
from pagoda.layers import bind_layer_ops, check_tensor_parallel_support, prepare_linear_layers
from pagoda.lora.model_manager import LoRAModelManager, lora_dtype
from pagoda.model_loader import iter_weights
from pagoda.model_loader.kv_scales import CheckpointKVScales
from pagoda.models.adapters import as_pooling_model
from pagoda.models.interface import (
    is_pooling_model,
    supports_multimodal,
    supports_output_rows,
    supports_pp,
    supports_token_type_ids,
)
from pagoda.models.registry import ModelChoice, ModelRegistry
from pagoda.platforms import Platform
from pagoda.quantization.model import checkpoint_module_filter, process_weights_after_loading, quantize_model, trim_heap
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.encoder_runner import EncoderRunner, has_mm_rows
from pagoda.worker.graphs import DecodeGraphRunner, GraphInputs, create_decode_graphs
from pagoda.worker.host_memory import zeros_lazy
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.kv_cache_sizing import KVCacheLayout, check_holds_one_request, pooling_num_blocks
from pagoda.worker.output_heads import GenerateHead, OutputHead, PoolingHead
from pagoda.worker.pipeline_stage import send_to_next_stage, stage_inputs, take_scheduled_tokens
from pagoda.worker.step_inputs import StepInputs, prepare_step_inputs

logger = logging.getLogger(__name__)

# the order supported pooling tasks are listed in (the first is a request's default)
POOLING_TASK_ORDER = ("embed", "classify", "score", "token_embed", "token_classify")


@dataclass
class MemoryReport:
    weights_bytes: int
    activation_peak_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    # False where the platform's KV budget does not read the peak, so no dummy step measured it
    activation_measured: bool = True

    @property
    def max_concurrent_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gib = 1 << 30
        activation = (f"activation peak {self.activation_peak_bytes / gib:.3f} GiB (measured on a max-size dummy step)"
                      if self.activation_measured else "activation peak not measured (the platform's KV budget is absolute)")
        return (
            f"memory: weights {self.weights_bytes / gib:.3f} GiB, {activation}, KV cache {self.kv_cache_bytes / gib:.3f} GiB = "
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.max_concurrent_tokens} tokens"
        )


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device()
        # resolved with the config (pagoda.engine.config_resolution.prepare_engine_config)
        model = config.resolved
        self.source = model.source
        self.hf_config = model.hf_config
        self.text_config = model.text_config
        self.dtype = model.dtype
        self.block_size: int = config.block_size
        self.max_model_len: int = model.max_model_len
        # "generate" (logits -> sampler) or "pooling" (hidden states -> the model's pooler)
        self.runner_type: str = model.runner_type
        self.pooling_info = model.pooling
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.memory: MemoryReport | None = None
        # CUDA graphs for decode steps (pagoda.worker.graphs); None: every step runs eagerly.
        self.graphs: DecodeGraphRunner | None = None
        # what the last stage does with the hidden states (sampler or pooler), built with the KV cache
        self.head: OutputHead
        # which implementation serves the model (pagoda.models.registry), set by load_model
        self.model_choice: ModelChoice | None = None
        # this rank's pipeline group (one rank without pipeline parallelism)
        self.pp = get_pp_group()
        # enable_lora: the adapters' host cache and slots (pagoda.lora.model_manager), set by load_model
        self.lora_manager: LoRAModelManager | None = None
        # a SupportsMultiModal model's encoder runs and encoder-output cache, set by load_model
        self.encoder_runner: EncoderRunner | None = None
        # sleep mode: 0 awake, 1 the KV cache dropped, 2 the weights too
        self.sleep_level = 0

    # -- set-up --------------------------------------------------------------
    def load_model(self) -> None:
        """resolve the class -> build it -> check parallelism -> quantize and load weights -> bind kernels."""
        t0 = time.perf_counter()
        cls, init_kwargs, arch = self._model_class()
        model = self._instantiate(cls, init_kwargs)
        self._check_parallelism(model, arch)
        self._load_weights(model)
        self.model = model.to(device=self.device).eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # before the kernels: a layer with an adapter keeps its activation out of the matmul
        self.lora_manager = self._lora_manager(arch)
        self._bind_kernels(arch, time.perf_counter() - t0)
        if supports_multimodal(self.model):
            self.encoder_runner = EncoderRunner(self.model, self.device)

    def _lora_manager(self, arch: str) -> LoRAModelManager | None:
        lora = self.config.lora_config
        if lora is None:
            return None
        assert lora.max_cpu_loras is not None  # resolved by prepare_engine_config
        manager = LoRAModelManager(self.model, arch, max_loras=lora.max_loras, max_cpu_loras=lora.max_cpu_loras,
                                   max_lora_rank=lora.max_lora_rank, dtype=lora_dtype(lora.lora_dtype, self.dtype),
                                   device=self.device, kernel=self.platform.lora_kernel(self.dtype))
        logger.info("%s", manager.describe())
        return manager

    @property
    def lora(self) -> LoRAModelManager:
        """The adapters of an engine with enable_lora (ValueError without it)."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return self.lora_manager

    def _model_class(self) -> tuple[type, dict[str, Any], str]:
        """-> (the class that serves the model, its extra constructor arguments, the architecture)."""
        archs = list(getattr(self.hf_config, "architectures", None) or [])
        if not archs:
            raise ValueError(f"the model config at {self.source.path} names no architectures; pass hf_overrides={{'architectures': [...]}}")
        model_config = self.config.model
        info = self.pooling_info
        if info is not None and info.architecture:
            archs = [info.architecture]  # a generative sibling that the conversion serves
        choice = ModelRegistry.resolve(archs, model_config.model_impl, self.hf_config, model_config.trust_remote_code)
        logger.info("%s", choice.describe())
        self.model_choice = choice
        cls = choice.load()
        init_kwargs = dict(choice.init_kwargs)
        if info is not None:
            if info.convert_type != "none":
                cls = as_pooling_model(cls, info.convert_type)
            elif not is_pooling_model(cls):
                raise ValueError(f"{choice.cls} is registered with runner 'pooling' but is no pooling model "
                                 "(its class does not inherit pagoda.models.interface.PoolingModel)")
            init_kwargs["pooler_config"] = info.pooler_config
        return cls, init_kwargs, archs[0]

    def _instantiate(self, cls: type, init_kwargs: dict[str, Any]) -> Any:
        """The model with uninitialised parameters of the model dtype, on the target device."""
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                return cls(self.hf_config, self.dtype, **init_kwargs)
        finally:
            torch.set_default_dtype(prev)

    def _check_parallelism(self, model: Any, arch: str) -> None:
        if self.pp.world_size > 1 and (not supports_pp(model) or self.runner_type != "generate"):
            raise ValueError(f"{arch} does not support pipeline parallelism (its model class does not declare "
                             "SupportsPP; pooling models never do); run it with pipeline_parallel_size=1")
        if self.config.parallel_config.tensor_parallel_size > 1:
            check_tensor_parallel_support(model, arch)

    def _load_weights(self, model: Any) -> None:
        """Quantization methods first (they replace the untouched float weights with their own), then the
        checkpoint's tensors; its fp8 KV cache scales go to the attention layers, not the family's loader."""
        quant_config = self.config.resolved.quant_config
        keep_quantized = None
        if quant_config is not None:
            keep_quantized = checkpoint_module_filter(model, quantize_model(model, quant_config))
        # Every tensor is cast to the parameters' one dtype on load: a GGUF file's
        # conversion can then be cached already cast (pagoda.model_loader.convert_cache).
        param_dtypes = {p.dtype for p in model.parameters()}
        cache_dtype = self.dtype if param_dtypes == {self.dtype} else None
        # The model raises on missing or unexpected weights: only it knows how
        # checkpoint tensors map onto its fused parameters.
        kv_scales = CheckpointKVScales(model)
        model.load_weights(kv_scales.take(iter_weights(self.source, self.config.load_config.load_format, cache_dtype,
                                                       keep_quantized)))
        self.checkpoint_kv_scales = kv_scales
        if quant_config is not None:
            logger.info("%s (%d layers)", quant_config.describe(), process_weights_after_loading(model))
        _drop_weight_loaders(model)

    def _bind_kernels(self, arch: str, load_seconds: float) -> None:
        """The platform's linear kernel and layer ops, where it has them."""
        kernel = self.platform.linear_kernel(self.dtype)
        prepared = prepare_linear_layers(self.model, kernel) if kernel is not None else 0
        ops = self.platform.layer_ops(self.dtype)
        bound = bind_layer_ops(self.model, ops) if ops is not None else 0
        logger.info(
            "loaded %s (%s) in %.2fs; linear kernel: %s (%d layers); layer ops: %s (%d modules)",
            arch, self.dtype, load_seconds, kernel.name if kernel else "F.linear", prepared,
            ops.name if ops is not None else "torch", bound,
        )

    def supported_tasks(self) -> tuple[str, ...]:
        """("generate",) for a generative model; a pooling model's pooler tasks (vLLM's order)."""
        if self.runner_type == "generate":
            return ("generate",)
        tasks = self.model.pooler.get_supported_tasks()
        return tuple(t for t in POOLING_TASK_ORDER if t in tasks)

    def attention_spec(self) -> AttentionSpec:
        layer = next(m for m in self.model.modules() if isinstance(m, Attention))
        return AttentionSpec(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            dtype=self.dtype,
            device_type=self.device.type,
            block_size=self.block_size,
            sliding_window=layer.sliding_window,
            logits_soft_cap=layer.logits_soft_cap,
            causal=layer.causal,
            alibi_slopes=layer.alibi_slopes_tuple(),
            kv_cache_dtype=self.kv_cache_dtype(),
        )

    def kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype when it is not the model's (``kv_cache_dtype``), else None."""
        dtype = resolve_kv_cache_dtype(self.config.cache_config.cache_dtype, self.dtype)
        return None if dtype == self.dtype else dtype

    def init_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int | None = None) -> MemoryReport:
        """Size (unless ``num_blocks`` is given: the ranks agreed on it) and allocate the KV cache, then
        build what reads it: the persistent batch, the output head and the decode graphs."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        spec = self._select_attention_backend()
        layout = KVCacheLayout.of(spec, len(self.attn_layers))
        activation = self._activation_peak(max_num_batched_tokens, spec.cache_dtype)
        self.num_blocks = self._num_kv_blocks(layout, activation, num_blocks)
        self._allocate_kv_cache(spec, self.num_blocks)
        self._build_batch_and_head(layout.blocks_for(self.max_model_len))
        self.memory = MemoryReport(self.weights_bytes, activation, self.num_blocks * layout.bytes_per_block,
                                   self.num_blocks, self.block_size, layout.bytes_per_block,
                                   activation_measured=self.platform.measures_activation_peak)
        self._log_memory(spec.cache_dtype, layout)
        # Last: graphs bake in the bound KV caches and the batch's block-table width (pooling never decodes).
        self.graphs = self._decode_graphs() if self.runner_type == "generate" and self.pp.world_size == 1 else None
        # after the profile and any graph capture: the scales come from the first real step
        for layer in self.attn_layers:
            layer.calculate_kv_scales = self.config.cache_config.calculate_kv_scales
        return self.memory

    # -- sleep mode (vLLM's sleep / wake_up; the engine core checks that no request runs) --------------
    def sleep(self, level: int) -> None:
        """Level 1: drop the KV cache (and what reads it); level 2: the weights too. The memory goes back
        to the allocator and, on the host, to the OS; ``wake_up`` rebuilds what was dropped."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            raise ValueError(f"the engine is asleep already (level {self.sleep_level}): wake it up first")
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        for layer in self.attn_layers:
            layer.kv_cache = None  # (bind wants a tensor; a sleeping layer is never called)
        self.kv_caches = []
        del self.head, self.batch
        if level == 2:
            self.attn_layers = []
            self.model = None
            self.lora_manager = None
            # it holds the model; load_model builds it again (an item it had cached is re-encoded from
            # its request's own tensors, as after a failed step)
            self.encoder_runner = None
        self.sleep_level = level
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_heap()

    def wake_up(self) -> None:
        """Undo ``sleep``: reload the weights (level 2) from the checkpoint, then reallocate a KV cache of the
        same number of blocks (the scheduler's block table still counts them). Asleep or not: no-op when awake."""
        level = self.sleep_level
        if not level:
            return
        if level == 2:
            self.load_model()
        self.init_kv_cache(self.max_num_seqs, self.max_num_batched_tokens, self.num_blocks)
        self.sleep_level = 0

    def _select_attention_backend(self) -> AttentionSpec:
        """The attention backend for this model's layers (and the spec it was chosen for)."""
        spec = self.attention_spec()
        backend_cls = select_attention_backend(self.platform, spec, self.config.device_config.attention_backend)
        self.attn_backend = backend_cls(spec)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.config.cache_config.calculate_kv_scales and not is_fp8(spec.cache_dtype):
            raise ValueError(f"calculate_kv_scales computes fp8 KV cache scales; kv_cache_dtype="
                             f"{self.config.cache_config.cache_dtype!r} is not fp8")
        return spec

    def _activation_peak(self, max_num_batched_tokens: int, cache_dtype: torch.dtype) -> int:
        """The activation peak the platform's KV budget subtracts; 0 where the budget does not read it.

        A device whose memory the activations and the cache share (CUDA, ROCm, TPU) measures it on a
        max-size dummy step: an estimate could under-size what a step really allocates. A host
        platform's budget is absolute (``measures_activation_peak`` False): the step, a 2,048-token
        batch through the model's kernels (~40% of the CPU start-up measured), would buy nothing.
        """
        if not self.platform.measures_activation_peak:
            return 0
        return self._profile_activation_peak(max_num_batched_tokens, cache_dtype)

    def _num_kv_blocks(self, layout: KVCacheLayout, activation: int, agreed: int | None) -> int:
        """The ranks' agreed count, else ``num_kv_blocks``, else the platform's budget (a pooling model's cut to a step)."""
        override = agreed if agreed is not None else self.config.cache_config.num_kv_blocks
        if override is not None:
            num_blocks = override
        else:
            budget = self.platform.kv_cache_budget_bytes(self.config, self.weights_bytes, activation)
            num_blocks = budget // layout.bytes_per_block
            if self.runner_type == "pooling":
                num_blocks = pooling_num_blocks(num_blocks, layout, self.max_num_batched_tokens, self.max_num_seqs,
                                                self.max_model_len)
        check_holds_one_request(num_blocks, layout, self.max_model_len)
        return num_blocks

    def _allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int) -> None:
        """One cache tensor per attention layer, bound to it, then faulted in where the platform does that."""
        shape = type(self.attn_backend).kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: masked-out slots are multiplied by 0 and must not hold NaN
        self.kv_caches = [zeros_lazy(shape, spec.cache_dtype, self.device) for _ in self.attn_layers]
        for layer, cache in zip(self.attn_layers, self.kv_caches):
            layer.bind(self.attn_backend, cache)
        self.platform.prefault_kv_cache(self.kv_caches)

    def _build_batch_and_head(self, max_blocks_per_req: int) -> None:
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, max_blocks_per_req,
                                with_token_type_ids=self.uses_token_type_ids)
        # a pooling model samples nothing: its pooler replaces the sampler
        self.head: OutputHead = (PoolingHead(self.model, self.batch) if self.runner_type == "pooling" else
                                 GenerateHead.build(self.model, self.batch, self.config, self.text_config, self.device))

    def _log_memory(self, cache_dtype: torch.dtype, layout: KVCacheLayout) -> None:
        assert self.memory is not None
        logger.info("%s", self.memory.describe())
        if cache_dtype != self.dtype:
            model_elem = torch.empty((), dtype=self.dtype).element_size()
            elem = layout.element_bytes
            logger.info("KV cache dtype %s (%s, %d byte(s) a value): the same budget holds %gx the blocks of a %s cache%s",
                        self.config.cache_config.cache_dtype, cache_dtype, elem, model_elem / elem, self.dtype,
                        self._kv_scales_source(cache_dtype))
        elif self.checkpoint_kv_scales.loaded:
            # as vLLM: a checkpoint's fp8 scales apply to an fp8 cache only
            logger.info("checkpoint KV cache scales (%s) ignored: kv_cache_dtype=%r is not fp8",
                        self.checkpoint_kv_scales.describe(), self.config.cache_config.cache_dtype)

    def _decode_graphs(self) -> DecodeGraphRunner | None:
        """Decode graphs over the bound caches, or None (the reason is logged): every step runs eagerly."""
        spec = self.config.speculative_config
        inputs = GraphInputs(
            model=self.model, attn_backend=self.attn_backend, attn_layers=self.attn_layers,
            max_blocks_per_req=self.batch.block_table.shape[1], max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            device=self.device, max_query_len=1 + (spec.k if spec is not None else 0),
        )
        return create_decode_graphs(self.platform, self.config, inputs)

    def _kv_scales_source(self, cache_dtype: torch.dtype) -> str:
        """Where an fp8 cache's k_scale / v_scale come from, for the log (vLLM's order of precedence)."""
        if not is_fp8(cache_dtype):
            return ""
        if self.config.cache_config.calculate_kv_scales:
            ignored = " (the checkpoint's are not used)" if self.checkpoint_kv_scales.loaded else ""
            return f"; k_scale / v_scale from the first step (calculate_kv_scales){ignored}"
        if self.checkpoint_kv_scales.loaded:
            unscaled = len(self.attn_layers) - sum(layer.kv_scales_from_checkpoint for layer in self.attn_layers)
            rest = f"; {unscaled} layer(s) without: 1.0" if unscaled else ""
            return f"; k_scale / v_scale from the checkpoint ({self.checkpoint_kv_scales.describe()}{rest})"
        return "; k_scale = v_scale = 1.0 (none in the checkpoint, no calculate_kv_scales)"

    @torch.inference_mode()
    def _profile_activation_peak(self, num_tokens: int, cache_dtype: torch.dtype) -> int:
        """Run one max-size prefill on a throwaway cache and measure the peak it adds."""
        spec = self.attention_spec()
        num_tokens = max(1, min(num_tokens, self.max_model_len))
        nblocks = -(-num_tokens // self.block_size) + 1
        shape = type(self.attn_backend).kv_cache_shape(nblocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        scratch = [torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in self.attn_layers]
        for layer, cache in zip(self.attn_layers, scratch):
            layer.bind(self.attn_backend, cache)
        positions = torch.arange(num_tokens, device=self.device)
        md = AttentionMetadata(
            num_seqs=1, num_tokens=num_tokens,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            slot_mapping=positions.clone(),
            max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc_cpu=torch.tensor([0, num_tokens], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([num_tokens], dtype=torch.int32),
        )
        md = self.attn_backend.prepare(md)
        stats = self.platform.memory_stats()
        before = stats.get("peak_bytes", _rss_peak_bytes()) if stats else _rss_peak_bytes()
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        # a later pipeline stage profiles on zeros: nothing is sent between stages before the first step
        hidden = self.model(ids, positions, md, **self._extra_inputs(torch.zeros_like(ids)),
                            **stage_inputs(self.pp, self.model, num_tokens, self.dtype, self.device, receive=False))
        if self.runner_type == "generate" and self.pp.is_last_rank:
            self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler_config.max_num_seqs):])
        self.platform.synchronize()
        stats = self.platform.memory_stats()
        after = stats.get("peak_bytes", _rss_peak_bytes()) if stats else _rss_peak_bytes()
        del scratch, hidden
        return max(after - before, 0)

    # -- per step -------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """prepare inputs -> forward -> (last stage) the output head: sampler or pooler."""
        self._apply_diffs(so)
        if self.encoder_runner is not None:
            self.encoder_runner.run_encoders(so, self.batch)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput.empty([])
        step = prepare_step_inputs(self.batch, so, self.block_size)
        if self.lora_manager is not None:
            slots = self.batch.lora_slot[step.token_rows]
            self.lora_manager.set_step(slots if slots.max() >= 0 else None)
        hidden, only_sampled_rows = self._forward(step)
        self.batch.num_computed[step.rows] = step.seq_lens
        if not self.pp.is_last_rank:
            # no waiting for the last stage: the next batch can start here while this one runs there
            send_to_next_stage(self.pp, hidden)
            return ModelRunnerOutput.empty(step.req_ids)
        return self.head(hidden, step, so, only_sampled_rows)

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor, bool]:
        """-> (hidden states, whether they hold only the rows that sample). A pure-decode step replays a
        captured graph where one serves it; every other step runs eagerly (a step with image placeholders
        among its tokens too: it runs on input embeddings)."""
        dev = self.device
        input_ids: torch.Tensor | None = None
        extra: dict[str, Any] = {}
        if self.encoder_runner is not None and has_mm_rows(step, self.batch):
            input_ids = torch.from_numpy(step.input_ids).to(dev, non_blocking=True)
            embeds = self.encoder_runner.inputs_embeds(step, self.batch, input_ids)
            if embeds is not None:
                extra["inputs_embeds"] = embeds
        if self.graphs is not None and not step.wants_prompt_logprobs and not extra:
            hidden = self.graphs.replay(step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                                        step.block_tables, step.num_scheduled)
            if hidden is not None:
                return hidden, False
        if self.batch.token_type_ids is not None:
            token_types = self.batch.token_type_ids[step.token_rows, step.positions]
            extra.update(self._extra_inputs(torch.from_numpy(token_types).to(dev, non_blocking=True)))
        extra.update(stage_inputs(self.pp, self.model, step.num_tokens, self.dtype, dev, receive=True))
        output_rows = self._output_rows(step)
        if output_rows is not None:
            extra["output_rows"] = torch.from_numpy(output_rows).to(dev, non_blocking=True)
        md = self.attn_backend.prepare(step.attention_metadata(dev))
        if input_ids is None:
            input_ids = torch.from_numpy(step.input_ids).to(dev, non_blocking=True)
        hidden = self.model(input_ids, torch.from_numpy(step.positions).to(dev, non_blocking=True), md, **extra)
        return hidden, output_rows is not None

    def _output_rows(self, step: StepInputs) -> np.ndarray | None:
        """The rows an eager step's model may return alone (each sampling request's last token), or None
        for all of them: only where the model supports it and no caller reads other rows."""
        # (LoRA: the step's token -> slot mapping covers every row, so every layer computes every row)
        if (self.runner_type != "generate" or step.wants_prompt_logprobs or not self.pp.is_last_rank
                or not supports_output_rows(self.model) or self.lora_manager is not None):
            return None
        rows = step.logits_rows
        return rows if len(rows) < step.num_tokens else None

    def _apply_diffs(self, so: SchedulerOutput) -> None:
        sampler = self.head.sampler if isinstance(self.head, GenerateHead) else None
        for rid in so.finished_req_ids:
            state = self.batch.remove(rid)
            if state is not None and state.beam is None and sampler is not None:
                sampler.remove(state)
        for new in so.scheduled_new_reqs:
            state = self.batch.add(new)
            if new.lora_request is not None:
                self._activate_lora(state.row, new.lora_request)
            if sampler is not None and state.beam is None:
                # beam rows never sample: the scheduler picks their tokens
                sampler.add(state)
        for diff in so.scheduled_cached_reqs:
            row = self.batch.rows[diff.req_id].row
            if diff.replace_block_ids:
                self.batch.replace_blocks(row, diff.new_block_ids)
            else:
                self.batch.append_blocks(row, diff.new_block_ids)
            if diff.new_token_ids:
                self.batch.append_tokens(row, diff.new_token_ids)
            if diff.scheduled_output_token_ids:
                # pipeline parallelism: tokens the last stage sampled; that stage has them already
                take_scheduled_tokens(self.batch, row, diff.scheduled_output_token_ids,
                                      diff.num_computed_tokens + so.num_scheduled_tokens[diff.req_id])
            self.batch.num_computed[row] = diff.num_computed_tokens
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            # the drafts are the row's inputs after its last token; they become its tokens only once accepted
            row = self.batch.rows[rid].row
            start = int(self.batch.num_tokens[row])
            self.batch.token_ids[row, start:start + len(drafts)] = drafts
        if so.block_copies:
            src = torch.tensor([s for s, _ in so.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in so.block_copies], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    def _activate_lora(self, row: int, lora_request: Any) -> None:
        """Put the row's adapter in a slot (the adapters of the other rows keep theirs)."""
        pinned = {s.lora_request.lora_int_id for s in self.batch.rows.values() if s.lora_request is not None}
        self.batch.lora_slot[row] = self.lora.activate(lora_request, pinned)

    @property
    def uses_token_type_ids(self) -> bool:
        """The model reads token type ids (BERT-style embeddings); the batch keeps them per row."""
        return supports_token_type_ids(self.model)

    def _extra_inputs(self, token_type_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"token_type_ids": token_type_ids} if self.uses_token_type_ids else {}


def _drop_weight_loaders(model: torch.nn.Module) -> None:
    """A parameter's ``weight_loader`` is its layer's bound method or a closure over the layer: a cycle
    (parameter -> loader -> layer -> parameter) only the collector can free. In an engine-core process the
    start-up heap is frozen out of the collector, so sleep level 2 would keep such weights for good; once
    the checkpoint is in, nothing calls the loaders again (a wake-up builds a new model)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if "weight_loader" in tensor.__dict__:
            del tensor.weight_loader
