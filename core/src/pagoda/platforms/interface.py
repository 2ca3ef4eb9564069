"""The interface every hardware platform plugin implements.

Every method core calls on a platform is declared here, with the default a
platform gets when it does not override it; core never probes a platform with
``getattr``/``hasattr``. ``core/tests/test_platforms.py`` checks that each
name core calls on a platform is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.layers import LayerOps, LinearKernel
    from pagoda.lora.punica import LoRAKernel
    from pagoda.worker.cpu_share import CpuShare
    from pagoda.worker.graphs import GraphCapturer


@dataclass(frozen=True)
class PlatformDefaults:
    """What a platform chooses where the user chose nothing (``Platform.config_defaults``).

    The platform never writes the engine config: ``pagoda.engine.config_resolution``
    applies these where the user gave no value, and logs each one with its source.
    """

    # tokens per KV cache block
    block_size: int = 16
    # the step budget (max_num_batched_tokens); None: the engine's own rule (2048 tokens, or the
    # context length when chunked prefill is off)
    max_num_batched_tokens: int | None = None
    # where that budget comes from, for the start-up log (e.g. "this CPU's measured matmul curve")
    max_num_batched_tokens_source: str = ""
    # True: the budget is measured by the process that runs the kernels (``Platform.engine_core_step_budget``,
    # in the engine core, once the model's dtype is known), not here: on a fresh machine the measurement
    # waits for a kernel build, which the API process would otherwise wait for before the core could start.
    # Applies only where the user set no budget and chunked prefill is on; ``max_num_batched_tokens`` is unused.
    max_num_batched_tokens_in_engine_core: bool = False
    # decode graphs at all (False: every step runs eagerly, whatever cuda_graph_sizes says), and the
    # batch sizes captured when the user names none
    graphs: bool = False
    graph_sizes: tuple[int, ...] = ()
    # why graphs are off, when they are (for the start-up log)
    graphs_off_reason: str = ""
    # True: chunked prefill is on whatever the user asked (XLA compiles one graph per step shape)
    requires_chunked_prefill: bool = False
    # how the KV cache budget is chosen when kv_cache_memory_bytes is not given (for the start-up log)
    kv_cache_budget_rule: str = ""


class Platform:
    """One kind of device. Subclasses live in platform plugins.

    ``probe`` must be cheap and honest: it may import the device runtime but must
    not initialise a device, and it says *why* the platform cannot run here.
    ``probe`` and ``kv_cache_budget_bytes`` have no default; everything else does.
    """

    # The name users select it by (``--device``, ``PAGODA_DEVICE``).
    name: ClassVar[str] = "base"
    # torch's device type for the tensors this platform runs ("cpu", "cuda", ...).
    device_type: ClassVar[str] = "cpu"
    # False for platforms whose code has never run on real hardware (shown by
    # `pagoda plugins list` and the docs).
    verified_on_hardware: ClassVar[bool] = True
    # Distribution that provides this platform (for install hints).
    package: ClassVar[str] = "pagoda-core"
    # True where decode steps can be captured as device graphs (then
    # ``cuda_graph_capture_sizes`` is asked for the sizes).
    supports_graphs: ClassVar[bool] = False
    # Quantization methods (vLLM names) this platform has kernels for; asking for another is an
    # error that says so (pagoda.quantization.resolve_quantization). vLLM's Platform.supported_quantization.
    supported_quantization: ClassVar[list[str]] = []
    # True where ``kv_cache_budget_bytes`` subtracts the activation peak, which the model runner then
    # measures on a max-size dummy step (a device whose memory activations and cache share: an
    # estimate could under-size what a step allocates). False where the budget is absolute: the
    # runner skips the dummy step and passes 0.
    measures_activation_peak: ClassVar[bool] = True

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """(True, "") if this platform can run here, else (False, reason)."""
        raise NotImplementedError

    # -- configuration ------------------------------------------------------
    def config_defaults(self, config: EngineConfig) -> PlatformDefaults:
        """This platform's defaults for ``config`` (read, never written); raise for what it cannot run.

        Called once, in the main process, by ``pagoda.engine.config_resolution.prepare_engine_config``
        before the model is resolved; the user's values win over every field returned.
        """
        return PlatformDefaults()

    def engine_core_step_budget(self, config: EngineConfig) -> int:
        """The step budget for ``config``'s resolved model, measured in the engine-core process; called
        (once, by ``pagoda.engine.config_resolution.resolve_in_engine_core``) only where ``config_defaults``
        set ``max_num_batched_tokens_in_engine_core``."""
        raise NotImplementedError(f"the {self.name} platform defers no step budget to the engine core")

    def supported_dtypes(self) -> list[torch.dtype]:
        """Model dtypes this platform runs; ``resolve_dtype`` refuses the others."""
        import torch

        return [torch.float32]

    def resolve_dtype(self, requested: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """Map ``dtype='auto'|'float32'|...`` to a torch dtype this platform runs."""
        import torch

        names = {
            "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
        }
        if requested == "auto":
            dtype = checkpoint_dtype or torch.float32
            if dtype not in self.supported_dtypes():
                dtype = torch.float32
        else:
            if requested not in names:
                raise ValueError(
                    f"dtype={requested!r} is not one of 'auto', {', '.join(repr(n) for n in names)}"
                )
            dtype = names[requested]
        if dtype not in self.supported_dtypes():
            supported = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
            raise ValueError(f"dtype {dtype} is not supported on platform {self.name!r} (supported: {supported})")
        return dtype

    def attention_backend_preference(self, spec: Any = None) -> list[str]:
        """Attention backends in the order this platform prefers them for ``spec``
        (an ``AttentionSpec``; None when asked without a model)."""
        return []

    def linear_kernel(self, dtype: torch.dtype) -> LinearKernel | None:
        """The matmul ``pagoda.layers.Linear`` layers use here, or None for plain ``F.linear``.

        Asked once after the weights are loaded; the kernel may re-lay-out each weight.
        """
        return None

    def lora_kernel(self, dtype: torch.dtype) -> LoRAKernel | None:
        """The batched LoRA shrink/expand (``pagoda.lora.punica.LoRAKernel``) here, or None for core's
        vectorised torch one. Asked once when an engine with enable_lora loads its model."""
        return None

    def layer_ops(self, dtype: torch.dtype) -> LayerOps | None:
        """The elementwise decoder ops (RMSNorm, SiLU-and-mul, RoPE) models use here, or None for torch's.

        Asked once after the weights are loaded; ``pagoda.layers.bind_layer_ops`` installs the result.
        """
        return None

    def cuda_graph_capture_sizes(self, config: EngineConfig) -> list[int]:
        """Decode batch sizes the model runner captures graphs for; [] runs every step eagerly.

        Only asked when ``supports_graphs``. The default returns the sizes the config resolution
        decided (the user's ``cuda_graph_sizes``, else ``config_defaults().graph_sizes``, [] with
        ``enforce_eager``).
        """
        return list(config.scheduler_config.cuda_graph_sizes or [])

    def graph_capturer(self, roots: list[object]) -> tuple[GraphCapturer | None, str]:
        """How decode steps are captured here (``pagoda.worker.graphs``), or (None, why not).

        Only asked when ``supports_graphs`` and capture sizes are set. ``roots``: the objects whose
        tensors a captured step may read besides its own (the model, the attention backend), for a
        capturer that must keep them alive. The default has no graph runtime.
        """
        return None, f"platform {self.name!r} has no graph runtime"

    def kv_cache_budget_bytes(self, config: EngineConfig, model_bytes: int, activation_bytes: int) -> int:
        """Absolute KV cache budget in bytes when the user gave none.

        ``model_bytes``: the loaded weights; ``activation_bytes``: the peak of a
        max-size dummy step, both measured by the model runner (0 where
        ``measures_activation_peak`` is False).
        """
        raise NotImplementedError

    def prefault_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Called once the KV cache is allocated, before any step: a host platform may fault the
        lazily mapped cache in here (``pagoda.worker.host_memory.populate``) so that requests do not
        pay first-touch page faults. The default does nothing."""

    def is_pin_memory_available(self, config: EngineConfig | None = None) -> bool:
        """Whether host buffers copied to the device may be pinned (page-locked).

        Pinning makes host-to-device copies asynchronous; it needs a CUDA/ROCm
        runtime, so the default is True exactly for ``device_type == "cuda"``.
        """
        return self.device_type == "cuda"

    # -- runtime -------------------------------------------------------------
    def device(self) -> torch.device:
        """The torch device the model, KV cache and step inputs live on."""
        import torch

        return torch.device(self.device_type)

    def init_worker(self, config: EngineConfig) -> None:
        """Per-process set-up before the model loads (threads, device selection)."""

    def set_cpu_share(self, cpus: list[int], config: EngineConfig) -> CpuShare:
        """Confine this rank's host threads to ``cpus`` (a many-model server's split of the machine between
        its awake engines; docs/server.md). The default pins every thread of the process there and runs
        one torch thread per CPU; a platform with its own thread setting overrides it to let that win."""
        from pagoda.worker.cpu_share import apply_cpu_share

        return apply_cpu_share(cpus)

    def seed_everything(self, seed: int) -> None:
        """Seed every random generator the engine's step may draw from (Python, numpy, torch)."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def get_device_communicator_cls(self) -> str:
        """``"module:Class"`` of the ``pagoda.distributed.DeviceCommunicatorBase`` subclass tensor- and
        pipeline-parallel ranks talk through here (gloo on CPU, NCCL on CUDA).

        The default refuses: a platform without one runs a single rank.
        """
        raise NotImplementedError(f"platform {self.name!r} provides no device communicator: "
                                  "tensor and pipeline parallelism are unavailable on it")

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def memory_stats(self) -> dict[str, Any]:
        """Device memory figures for the start-up log (e.g. ``total_bytes``, ``free_bytes``); {} when none."""
        return {}

    def describe(self) -> str:
        """One line for logs and ``pagoda plugins list`` (e.g. thread count, device name)."""
        return self.name
