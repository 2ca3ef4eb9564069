"""The CPU platform: torch on the host's cores."""

from __future__ import annotations

import logging
import os
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from pagoda import envs
from pagoda.platforms import Platform, PlatformDefaults

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.layers import LayerOps, LinearKernel
    from pagoda.worker.cpu_share import CpuShare
    from pagoda.worker.graphs import GraphCapturer
    from pagoda_platform_cpu.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

THREADS_ENV = "PAGODA_CPU_THREADS"
KVCACHE_SPACE_ENV = "PAGODA_CPU_KVCACHE_SPACE"  # GiB, as VLLM_CPU_KVCACHE_SPACE
# pagoda-only: "0" keeps F.linear with plain weights (for A/B measurements)
PACKED_LINEAR_ENV = "PAGODA_CPU_PACKED_LINEAR"
# pagoda-only: "0" leaves decode-sized inputs to oneDNN's packed matmul instead of the C++ GEMV
GEMV_ENV = "PAGODA_CPU_GEMV"
# pagoda-only: "0" runs linears on the GEMV + oneDNN instead of pagoda's packed AVX-512 matmul
GEMM_ENV = "PAGODA_CPU_GEMM"
# pagoda-only: "0" keeps torch ops for RMSNorm / SiLU-and-mul / RoPE instead of the fused C++ kernels
LAYER_OPS_ENV = "PAGODA_CPU_LAYER_OPS"
# The default KV cache (neither kv_cache_memory_bytes nor PAGODA_CPU_KVCACHE_SPACE given) follows the
# model: KVCACHE_WEIGHTS_RATIO x its weights, at least MIN_DEFAULT_KVCACHE_BYTES and one max_model_len
# request, at most DEFAULT_KVCACHE_GIB (vLLM's VLLM_CPU_KVCACHE_SPACE default, pagoda's default before).
# Why the weights: a decode step reads the weights once and every running sequence's KV; once those
# KV bytes are 8x the weights, more concurrency adds at most 1/9 to decode throughput, while every
# byte of the cache is faulted in (and resident) from start-up on. SmolLM2-135M Q4_1 (90 MB): 0.72 GB,
# 31K tokens, instead of 4 GiB (186K tokens, 3.7 s of prefault on the 2-vCPU guest); a model of
# 0.5 GB of weights or more gets the 4 GiB as before.
DEFAULT_KVCACHE_GIB = 4.0
KVCACHE_WEIGHTS_RATIO = 8
MIN_DEFAULT_KVCACHE_BYTES = 512 << 20
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# Decode batch sizes with a kernel graph when cuda_graph_sizes is not given (see default_graph_sizes).
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32)
GiB = 1 << 30


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_avx512f() -> bool:
    return "avx512f" in cpu_flags()


def has_native_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    verified_on_hardware = True
    package = "pagoda-platform-cpu"
    # quantization methods with CPU kernels (each method is a plugin; see docs/quantization.md)
    supported_quantization = ["gguf", "compressed-tensors", "gptq", "awq"]
    # kernel graphs (pagoda.cpp_extension.graph) for pure-decode steps
    supports_graphs = True
    # the KV budget is absolute (it never reads the activation peak): no max-size dummy step at start-up
    measures_activation_peak = False

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        return True, ""

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.float32, torch.bfloat16, torch.float16]

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        import torch

        if requested == "auto":
            dtype = self._auto_dtype()
            logger.info(
                "dtype=auto on CPU: %s (native bf16: %s; checkpoint dtype: %s)",
                dtype, has_native_bf16(), checkpoint_dtype,
            )
            return dtype
        return super().resolve_dtype(requested, checkpoint_dtype)

    @staticmethod
    def _auto_dtype() -> torch.dtype:
        import torch

        # bf16 only pays where the CPU computes it natively (AVX512-BF16 / AMX);
        # on AVX2 it is emulated and slower than fp32, whatever the checkpoint holds.
        return torch.bfloat16 if has_native_bf16() else torch.float32

    def attention_backend_preference(self, spec: Any = None) -> list[str]:
        # cpu_paged reads the paged cache in place (a JIT-compiled C++ kernel with explicit
        # SIMD): decode attention for 64 sequences x 192 tokens, 30 layers of scattered
        # blocks, measured 1.1 ms/layer fp32 and 0.9 ms bf16 against torch_paged's
        # gather + SDPA at 3.5 and 12 ms. torch_paged stays as the fallback when the
        # kernel cannot be compiled here.
        return ["cpu_paged", "torch_paged"]

    def linear_kernel(self, dtype: torch.dtype) -> LinearKernel | None:
        import torch

        from pagoda_platform_cpu.linear import GEMV_MAX_ROWS, GemvLinearKernel, OneDNNLinearKernel, onednn_available

        if not envs.PAGODA_CPU_PACKED_LINEAR:
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        if envs.PAGODA_CPU_GEMM:
            from pagoda_platform_cpu.gemm import PackedGemmKernel, unavailable_reason

            reason = unavailable_reason(dtype)  # compiles on first use; cached per machine afterwards
            if reason is None:
                # Faster than both the GEMV and oneDNN at every row count measured (1 row
                # included), so it serves every linear of this dtype alone, from one packed copy;
                # tile height and any rows oneDNN wins here come from this CPU's measurement.
                from pagoda_platform_cpu.gemm_tuning import tuning

                tuned = tuning(dtype)
                return PackedGemmKernel(
                    (dtype,), row_tile=tuned.row_tile, onednn_rows=tuned.onednn_rows, arena=self.packed_weight_arena
                )
            logger.info("pagoda's packed CPU matmul does not run %s here (%s); linears use the GEMV and oneDNN", dtype, reason)
        packer: LinearKernel | None = OneDNNLinearKernel() if onednn_available() else None
        if envs.PAGODA_CPU_GEMV:
            from pagoda_platform_cpu.gemv import build_failure

            failure = build_failure()  # compiles on first use; cached per machine afterwards
            if failure is None:
                return GemvLinearKernel(packer, max_rows=GEMV_MAX_ROWS[dtype])
            logger.warning("CPU GEMV unavailable, decode-sized linears use %s: %s", packer.name if packer else "F.linear", failure)
        return packer

    def layer_ops(self, dtype: torch.dtype) -> LayerOps | None:
        # Fused C++ kernels for the elementwise decoder ops (four calls a layer instead of ~25
        # small torch calls): a SmolLM2-135M decode step's forward outside linears and attention
        # measured 4.7 -> 2.3 ms fp32 and 4.5 -> 2.1 ms bf16 on the 2-vCPU AVX512 VM.
        import torch

        if not envs.PAGODA_CPU_LAYER_OPS:
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            return None  # the kernels cover float32 and bfloat16 only
        from pagoda.cpp_extension import ExtensionBuildError
        from pagoda_platform_cpu.layer_ops import cpu_layer_ops

        try:
            return cpu_layer_ops()  # compiles on first use; cached per machine afterwards
        except ExtensionBuildError as exc:
            logger.warning("fused CPU layer ops unavailable, using torch ops: %s", exc)
            return None

    def graph_capturer(self, roots: list[object]) -> tuple[GraphCapturer | None, str]:
        from pagoda.worker.graphs import KernelGraphCapture

        return KernelGraphCapture(roots), ""

    def num_threads(self) -> int:
        n: int | None = envs.PAGODA_CPU_THREADS  # a positive int, or a ValueError naming the variable
        if n is not None:
            return n
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def prefault_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        # The cache is mapped lazily, and the allocator goes round the whole pool before it reuses a
        # block: fault it in now, on every thread, not on requests' time (pagoda.worker.host_memory).
        if not envs.PAGODA_CPU_KVCACHE_PREFAULT:
            return
        import time

        import torch

        from pagoda.worker.host_memory import populate

        start = time.perf_counter()
        threads = torch.get_num_threads()
        populated = populate(kv_caches, threads=threads)
        logger.info("KV cache: %.2f GiB faulted in on %d threads in %.2f s", populated / (1 << 30), threads,
                    time.perf_counter() - start)

    def kv_cache_budget_bytes(self, config: EngineConfig, model_bytes: int, activation_bytes: int) -> int:
        if config.cache_config.kv_cache_memory_bytes is not None:
            return config.cache_config.kv_cache_memory_bytes
        gib: float | None = envs.PAGODA_CPU_KVCACHE_SPACE  # positive GiB, or a ValueError naming the variable
        if gib is not None:
            return int(gib * GiB)
        return default_kv_cache_bytes(config, model_bytes)

    def config_defaults(self, config: EngineConfig) -> PlatformDefaults:
        # first: the libraries compile in the background while the config resolves and the engine core starts
        start_kernel_builds()
        gib = envs.PAGODA_CPU_KVCACHE_SPACE
        return PlatformDefaults(
            # The smallest step at which this CPU's matmul is near its best rate (gemm_tuning): 512 where
            # it is there already (a bigger step only stalls the running decodes longer), more where the
            # curve still climbs (full-512-bit AVX-512 cores). Measured in the engine core, the process
            # that runs the matmul (engine_core_step_budget): on a fresh cache the measurement waits for
            # the matmul's build, which this process would otherwise wait for before the core could start.
            max_num_batched_tokens_in_engine_core=True,
            max_num_batched_tokens_source="this CPU's measured matmul curve (pagoda_platform_cpu.gemm_tuning)",
            # Kernel graphs (pagoda.cpp_extension.graph) for decode batches of 1-32: a graph keeps its
            # activations, and above ~32 rows a decode step's matmuls outweigh the per-call Python it saves.
            graphs=envs.PAGODA_CPU_KERNEL_GRAPHS,
            graph_sizes=default_graph_sizes(config.scheduler_config.max_num_seqs),
            graphs_off_reason="PAGODA_CPU_KERNEL_GRAPHS=0",
            kv_cache_budget_rule=(f"{gib} GiB (PAGODA_CPU_KVCACHE_SPACE)" if gib is not None
                                  else f"{DEFAULT_KVCACHE_GIB} GiB (PAGODA_CPU_KVCACHE_SPACE unset)"),
        )

    def engine_core_step_budget(self, config: EngineConfig) -> int:
        import torch

        from pagoda_platform_cpu.gemm_tuning import tuning

        if not (envs.PAGODA_CPU_PACKED_LINEAR and envs.PAGODA_CPU_GEMM and has_avx512f()):
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        dtype = config.resolved.dtype  # the model's, resolved with its checkpoint
        from pagoda_platform_cpu.gemm import unavailable_reason

        if dtype not in (torch.float32, torch.bfloat16) or unavailable_reason(dtype) is not None:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return tuning(dtype).max_num_batched_tokens

    def init_worker(self, config: EngineConfig) -> None:
        import torch

        n = self.num_threads()
        ranks = config.parallel_config.world_size
        if ranks > 1 and not envs.PAGODA_CPU_THREADS:
            # each rank is its own process on the same cores: share them instead of oversubscribing
            n = max(1, n // ranks)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        logger.info("CPU platform: %d torch threads", n)

    def set_cpu_share(self, cpus: list[int], config: EngineConfig) -> CpuShare:
        from pagoda.worker.cpu_share import apply_cpu_share

        # PAGODA_CPU_THREADS is the user's explicit count: it wins over a many-model server's split
        return apply_cpu_share(cpus, envs.PAGODA_CPU_THREADS, "PAGODA_CPU_THREADS")

    def get_device_communicator_cls(self) -> str:
        return "pagoda_platform_cpu.communicator:CpuCommunicator"

    def describe(self) -> str:
        return f"cpu ({self.num_threads()} threads, native bf16: {has_native_bf16()})"

    @cached_property
    def packed_weight_arena(self) -> HugePageArena:
        """The huge-page memory every packed weight this platform's matmul makes is cut from."""
        from pagoda_platform_cpu.huge_pages import HugePageArena

        return HugePageArena()


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes with a kernel graph when cuda_graph_sizes is not given: 1-32, and
    max_num_seqs itself below 32 (the largest decode batch pads into a graph too)."""
    sizes = [s for s in DEFAULT_GRAPH_SIZES if s <= max_num_seqs]
    if max_num_seqs < DEFAULT_GRAPH_SIZES[-1] and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def default_kv_cache_bytes(config: EngineConfig, model_bytes: int) -> int:
    """The KV cache budget when none is given: it follows the model (see KVCACHE_WEIGHTS_RATIO)."""
    from pagoda.worker.kv_cache_sizing import request_bytes_upper_bound

    follows_model = max(KVCACHE_WEIGHTS_RATIO * model_bytes, MIN_DEFAULT_KVCACHE_BYTES,
                        request_bytes_upper_bound(config))
    return min(follows_model, int(DEFAULT_KVCACHE_GIB * GiB))


def start_kernel_builds() -> None:
    """Begin compiling the C++ kernels this platform will ask for, in the background.

    An engine on this platform needs them only after its weights are loaded; started here, the
    compiles (a few seconds each on a fresh machine, a cache hit afterwards) run while the
    weights load. The same environment switches as ``linear_kernel`` and ``layer_ops`` decide
    which libraries are needed: the GEMV only where the packed matmul is off or cannot run.
    """
    if envs.PAGODA_CPU_PACKED_LINEAR:
        gemm_wanted = envs.PAGODA_CPU_GEMM and has_avx512f()
        if gemm_wanted:
            from pagoda_platform_cpu.gemm import EXTENSION as GEMM

            GEMM.start()
        if not gemm_wanted and envs.PAGODA_CPU_GEMV:
            from pagoda_platform_cpu.gemv import EXTENSION as GEMV

            GEMV.start()
    if envs.PAGODA_CPU_LAYER_OPS:
        from pagoda_platform_cpu.layer_ops import EXTENSION as LAYER_OPS

        LAYER_OPS.start()

