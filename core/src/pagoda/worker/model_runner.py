"""Runs the model on a flat batch: builds inputs from the persistent batch, runs
the forward pass, computes logits only where a token is sampled, samples."""

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
from pagoda.model_loader import iter_weights
from pagoda.model_loader.kv_scales import CheckpointKVScales
from pagoda.models.adapters import as_pooling_model
from pagoda.models.registry import ModelChoice, ModelRegistry
from pagoda.platforms import Platform
from pagoda.pooling.pooler import PoolingMetadata
from pagoda.quantization.model import checkpoint_module_filter, process_weights_after_loading, quantize_model
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.structured_output.backend import StructuredOutputBackend
from pagoda.structured_output.manager import load_backend_class
from pagoda.worker.graphs import DecodeGraphRunner, GraphInputs, create_decode_graphs
from pagoda.worker.host_memory import zeros_lazy
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.kv_cache_sizing import KVCacheLayout, check_holds_one_request, pooling_num_blocks
from pagoda.worker.pipeline_stage import send_to_next_stage, stage_inputs, take_scheduled_tokens
from pagoda.worker.sampling import RunnerSampler

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
        # structured outputs: the backend class whose kernel masks logits (loaded on the first constrained step)
        self._bitmask_backend: type[StructuredOutputBackend] | None = None
        self.platform = platform
        self.device = platform.device()
        # resolved with the config (pagoda.engine.core.prepare_engine_config)
        model = config.resolved
        self.source = model.source
        self.hf_config = model.hf_config
        self.text_config = model.text_config
        self.dtype = model.dtype
        self.block_size: int = config.cache_config.block_size or platform.default_block_size
        self.max_model_len: int = model.max_model_len
        # "generate" (logits -> sampler) or "pooling" (hidden states -> the model's pooler)
        self.runner_type: str = model.runner_type
        self.pooling_info = model.pooling
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.memory: MemoryReport | None = None
        # CUDA graphs for decode steps (pagoda.worker.graphs); None: every step runs eagerly.
        self.graphs: DecodeGraphRunner | None = None
        # which implementation serves the model (pagoda.models.registry), set by load_model
        self.model_choice: ModelChoice | None = None
        # this rank's pipeline group (one rank without pipeline parallelism)
        self.pp = get_pp_group()

    # -- set-up --------------------------------------------------------------
    def load_model(self) -> None:
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
            elif not getattr(cls, "is_pooling_model", False):
                raise ValueError(f"{choice.cls} is registered with runner 'pooling' but is no pooling model "
                                 "(is_pooling_model is not set)")
            init_kwargs["pooler_config"] = info.pooler_config
        t0 = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.hf_config, self.dtype, **init_kwargs)
        finally:
            torch.set_default_dtype(prev)
        if self.pp.world_size > 1 and (not getattr(model, "supports_pp", False) or self.runner_type != "generate"):
            raise ValueError(f"{archs[0]} does not support pipeline parallelism (its model class does not set "
                             "supports_pp; pooling models never do); run it with pipeline_parallel_size=1")
        if self.config.parallel_config.tensor_parallel_size > 1:
            check_tensor_parallel_support(model, archs[0])
        quant_config = self.config.resolved.quant_config
        keep_quantized = None
        if quant_config is not None:
            # before any weight is read: the methods replace the (untouched) float weights with their own
            keep_quantized = checkpoint_module_filter(model, quantize_model(model, quant_config))
        # Every tensor is cast to the parameters' one dtype on load: a GGUF file's
        # conversion can then be cached already cast (pagoda.model_loader.convert_cache).
        param_dtypes = {p.dtype for p in model.parameters()}
        cache_dtype = self.dtype if param_dtypes == {self.dtype} else None
        # The model raises on missing or unexpected weights: only it knows how
        # checkpoint tensors map onto its fused parameters.
        # fp8 KV cache scales the checkpoint carries go to the attention layers, not the family's loader
        kv_scales = CheckpointKVScales(model)
        model.load_weights(kv_scales.take(iter_weights(self.source, self.config.load_config.load_format, cache_dtype,
                                                       keep_quantized)))
        self.checkpoint_kv_scales = kv_scales
        if quant_config is not None:
            logger.info("%s (%d layers)", quant_config.describe(), process_weights_after_loading(model))
        self.model = model.to(device=self.device).eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kernel = self.platform.linear_kernel(self.dtype)
        prepared = prepare_linear_layers(self.model, kernel) if kernel is not None else 0
        ops = self.platform.layer_ops(self.dtype)
        bound = bind_layer_ops(self.model, ops) if ops is not None else 0
        logger.info(
            "loaded %s (%s) in %.2fs; linear kernel: %s (%d layers); layer ops: %s (%d modules)",
            archs[0], self.dtype, time.perf_counter() - t0, kernel.name if kernel else "F.linear", prepared,
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
        build what reads it: the persistent batch, the sampler and the decode graphs."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        spec = self._select_attention_backend()
        layout = KVCacheLayout.of(spec, len(self.attn_layers))
        activation = self._activation_peak(max_num_batched_tokens, spec.cache_dtype)
        self.num_blocks = self._num_kv_blocks(layout, activation, num_blocks)
        self._allocate_kv_cache(spec, self.num_blocks)
        self._build_batch_and_sampler(layout.blocks_for(self.max_model_len))
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

    def _build_batch_and_sampler(self, max_blocks_per_req: int) -> None:
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, max_blocks_per_req,
                                with_token_type_ids=self.uses_token_type_ids)
        # a pooling model samples nothing: its pooler replaces the sampler
        self.sampler = None if self.runner_type == "pooling" else RunnerSampler(
            self.config, self.text_config, self.batch, self.device)

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
        inputs = GraphInputs(
            model=self.model, attn_backend=self.attn_backend, attn_layers=self.attn_layers,
            max_blocks_per_req=self.batch.block_table.shape[1], max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            device=self.device,
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
    def _apply_diffs(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            state = self.batch.remove(rid)
            if state is not None and not state.num_beam_candidates and self.sampler is not None:
                self.sampler.remove(state)
        for new in so.scheduled_new_reqs:
            state = self.batch.add(
                new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids,
                new.num_computed_tokens, new.sampling_params, new.output_token_ids,
                num_beam_candidates=new.num_beam_candidates, beam_temperature=new.beam_temperature,
                pooling_params=new.pooling_params, token_type_ids=new.token_type_ids,
            )
            if self.sampler is None:
                continue
            if not state.num_beam_candidates:
                # beam rows never sample: the scheduler picks their tokens
                self.sampler.add(state)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            row = self.batch.rows[rid].row
            if cached.replace_block_ids and cached.replace_block_ids[i]:
                self.batch.replace_blocks(row, cached.new_block_ids[i])
            else:
                self.batch.append_blocks(row, cached.new_block_ids[i])
            if cached.new_token_ids and cached.new_token_ids[i]:
                self.batch.append_tokens(row, cached.new_token_ids[i])
            if cached.scheduled_output_token_ids and cached.scheduled_output_token_ids[i]:
                # pipeline parallelism: tokens the last stage sampled; that stage has them already
                take_scheduled_tokens(self.batch, row, cached.scheduled_output_token_ids[i],
                                      cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid])
            self.batch.num_computed[row] = cached.num_computed_tokens[i]
        if so.block_copies:
            src = torch.tensor([s for s, _ in so.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in so.block_copies], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    def _apply_grammar_bitmask(self, logits: torch.Tensor, sample_req_ids: list[str], so: SchedulerOutput) -> torch.Tensor:
        """Mask the constrained rows' logits with the scheduler's bitmask, one op for the batch."""
        ids = so.structured_output_request_ids
        rows = [ids.get(rid, -1) for rid in sample_req_ids]
        if max(rows) < 0:
            return logits
        if self._bitmask_backend is None:
            # the class only (its kernel is a static method): the backend instance lives beside the scheduler
            self._bitmask_backend = load_backend_class(self.config.structured_outputs_config.backend)
        # a row per sampled request, all ones (everything allowed) for the unconstrained ones
        bitmask = torch.full((len(rows), so.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
        constrained = [i for i, r in enumerate(rows) if r >= 0]
        bitmask[constrained] = so.grammar_bitmask[[rows[i] for i in constrained]]
        # float32 so a half-precision model's -inf fill and the sampler's in-place edits agree
        logits = logits.to(torch.float32)
        self._bitmask_backend.apply_token_bitmask(logits, bitmask.to(logits.device))
        return logits

    @property
    def uses_token_type_ids(self) -> bool:
        """The model reads token type ids (BERT-style embeddings); the batch keeps them per row."""
        return bool(getattr(self.model, "uses_token_type_ids", False))

    def _output_rows(self, cu: np.ndarray, samples: np.ndarray, total: int, wants_prompt_logprobs: bool) -> np.ndarray | None:
        """The rows an eager step's model may return alone (each sampling request's last token), or None
        for all of them: only where the model supports it and no caller reads other rows."""
        if (self.runner_type != "generate" or wants_prompt_logprobs or not self.pp.is_last_rank
                or not getattr(self.model, "supports_output_rows", False)):
            return None
        rows = cu[1:][np.nonzero(samples)[0]] - 1
        return rows if len(rows) < total else None

    def _extra_inputs(self, token_type_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"token_type_ids": token_type_ids} if self.uses_token_type_ids else {}

    def _pool(self, hidden: torch.Tensor, req_ids: list[str], rows: np.ndarray, cu: np.ndarray, start: np.ndarray,
              nsched: np.ndarray, done: np.ndarray) -> ModelRunnerOutput:
        """The pooler over each request whose prompt is all computed; float32 results on the host."""
        pooled: list[Any] = [None] * len(req_ids)
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], pooler_output=pooled)
        idx = np.nonzero(done)[0]
        if not len(idx):
            return result
        if (start[idx] != 0).any():
            # chunked prefill and prefix caching are off for pooling models: a prompt is one step
            raise RuntimeError("a pooling request reached the pooler without its whole prompt in the step")
        b = self.batch
        states = [b.rows[req_ids[i]] for i in idx.tolist()]
        params = [st.pooling_params for st in states]
        tokens = None
        if any(p.requires_token_ids for p in params):
            tokens = [torch.from_numpy(b.token_ids[rows[i], : nsched[i]].copy()) for i in idx.tolist()]
        md = PoolingMetadata(starts=cu[idx].tolist(), lengths=nsched[idx].tolist(), pooling_params=params,
                             prompt_token_ids=tokens)
        outputs = self.model.pooler(hidden, md)
        for i, out in zip(idx.tolist(), outputs):
            pooled[i] = out.detach().to("cpu", torch.float32)
        return result

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        b = self.batch
        rows = np.fromiter((b.rows[r].row for r in req_ids), dtype=np.int64, count=len(req_ids))
        nsched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        start = b.num_computed[rows]
        cu = np.empty(len(rows) + 1, dtype=np.int64)
        cu[0] = 0
        np.cumsum(nsched, out=cu[1:])
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(len(rows)), nsched)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - start, nsched)
        token_rows = rows[req_idx]
        input_ids = b.token_ids[token_rows, positions]
        slots = b.block_table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = start + nsched
        max_blocks = int((seq_lens.max() + self.block_size - 1) // self.block_size)
        block_tables = b.block_table[rows, :max_blocks]

        dev = self.device
        hidden = None
        # Only requests whose known tokens are all computed after this step sample.
        samples = seq_lens >= b.num_tokens[rows]
        only_sampled_rows = False  # the model returned just the sampled rows' hidden states (output_rows)
        wants_prompt_logprobs = bool(b.num_prompt_logprobs[rows].max() >= 0)
        if self.graphs is not None and not wants_prompt_logprobs:
            # A pure-decode step replays a captured graph; None: not one it can serve.
            hidden = self.graphs.replay(input_ids, positions, slots, seq_lens, block_tables, nsched)
        if hidden is None:
            qsl_cpu = torch.from_numpy(cu.astype(np.int32))
            seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
            md = AttentionMetadata(
                num_seqs=len(rows), num_tokens=total,
                query_start_loc=qsl_cpu.to(dev, non_blocking=True),
                seq_lens=seq_cpu.to(dev, non_blocking=True),
                block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev, non_blocking=True),
                slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
                max_query_len=int(nsched.max()), max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu,
                is_all_decode=bool((nsched == 1).all()),
            )
            md = self.attn_backend.prepare(md)
            extra = {}
            if b.token_type_ids is not None:
                extra = self._extra_inputs(torch.from_numpy(b.token_type_ids[token_rows, positions]).to(dev, non_blocking=True))
            extra.update(stage_inputs(self.pp, self.model, total, self.dtype, dev, receive=True))
            output_rows = self._output_rows(cu, samples, total, wants_prompt_logprobs)
            if output_rows is not None:
                extra["output_rows"] = torch.from_numpy(output_rows).to(dev, non_blocking=True)
                only_sampled_rows = True
            hidden = self.model(
                torch.from_numpy(input_ids).to(dev, non_blocking=True),
                torch.from_numpy(positions).to(dev, non_blocking=True),
                md,
                **extra,
            )
        b.num_computed[rows] = seq_lens
        if not self.pp.is_last_rank:
            # no waiting for the last stage: the next batch can start here while this one runs there
            send_to_next_stage(self.pp, hidden)
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        if self.runner_type == "pooling":
            return self._pool(hidden, req_ids, rows, cu, start, nsched, samples)
        sampler = self.sampler
        assert sampler is not None  # a generative model always has one
        sample_idx = np.nonzero(samples)[0]
        sampled: list[list[int]] = [[] for _ in req_ids]
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        if wants_prompt_logprobs:
            result.prompt_logprobs = sampler.prompt_logprobs(self.model, hidden, req_ids, rows, start, nsched, cu)
        if len(sample_idx):
            if only_sampled_rows:
                logits = self.model.compute_logits(hidden)  # the model returned exactly these rows
            else:
                logits_rows = torch.from_numpy(cu[1:][sample_idx] - 1).to(dev)
                logits = self.model.compute_logits(hidden.index_select(0, logits_rows))
            beam_k = b.num_beam_candidates[rows[sample_idx]]
            if beam_k.any():
                is_beam = beam_k > 0
                beam_idx = sample_idx[is_beam]
                result.beam_candidates = sampler.beam_candidates(
                    logits[torch.from_numpy(np.nonzero(is_beam)[0]).to(dev)], [req_ids[i] for i in beam_idx], rows[beam_idx]
                )
                keep = np.nonzero(~is_beam)[0]
                sample_idx = sample_idx[keep]
                logits = logits[torch.from_numpy(keep).to(dev)]
        if len(sample_idx):
            sample_rows = rows[sample_idx]
            if so.structured_output_request_ids:
                logits = self._apply_grammar_bitmask(logits, [req_ids[i] for i in sample_idx], so)
            tokens = sampler.sample(logits, sample_rows, [req_ids[i] for i in sample_idx], result)
            # The runner keeps its own copy of each request's tokens for the next step's inputs.
            b.token_ids[sample_rows, b.num_tokens[sample_rows]] = tokens
            b.num_tokens[sample_rows] += 1
            for i, tok in zip(sample_idx.tolist(), tokens.tolist()):
                sampled[i].append(tok)
        return result
