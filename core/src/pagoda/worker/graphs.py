"""Graph capture and replay of the model's forward pass for pure-decode steps: CUDA graphs on a GPU,
kernel graphs (``pagoda.cpp_extension.graph``) on CPU.

A decode step of ``n`` requests runs the same kernels for every ``n`` of a
given size, with only data changing. At start-up the runner captures one graph
per capture size ``N`` (largest first, all in one memory pool) over static
device buffers; a decode step with ``n <= max(N)`` is then padded up to the
next captured size, its inputs are copied into the static buffers and the
graph is replayed, which saves the per-kernel launch cost that dominates small
decode batches on a GPU.

On CPU the capture is a kernel graph (``pagoda.cpp_extension.graph``: the forward's
kernel calls recorded and replayed from C); its capture is itself one forward, so it
needs no warm-up runs. A forward that cannot be captured leaves that engine eager.

Padding rows carry slot -1 (the KV-write kernels skip negative slots, so they
write nothing), token 0 at position 0, and seq_len 1 over block 0, the
engine's reserved null block (never handed out). Every layer treats rows
independently, so padding never changes a real row's result; the runner reads
only the first ``n`` rows of the static output.

Everything else runs eagerly: prefills and mixed steps, steps larger than the
largest capture size, steps that want prompt logprobs, ``enforce_eager``,
platforms without graphs and attention backends that do not declare
``supports_cuda_graphs`` (GPU) or ``supports_kernel_graphs`` (CPU). A captured graph bakes in each backend's per-step
host decisions (``prepare``), so the static metadata is prepared once per size
with ``max_seq_len = max_model_len``, an upper bound valid for every replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagoda.attention import AttentionMetadata
from pagoda.distributed import get_tensor_model_parallel_world_size
from pagoda.models.interface import supports_cuda_graphs

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.platforms import Platform
    from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PAD_SLOT = -1
# Warm-up runs before each capture: the first compiles Triton kernels and
# builds lazily created tables (RoPE cos/sin), which must not happen while capturing.
NUM_WARMUP_RUNS = 2


@dataclass
class CapturedStep:
    """One captured forward: ``replay()`` refreshes ``output`` from the static inputs."""

    replay: Callable[[], None]
    output: torch.Tensor


class Capturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep: ...


class CudaGraphCapture:
    """Real capture: ``torch.cuda.CUDAGraph`` per size, one memory pool shared by all of them.

    Sizes are captured largest first so the smaller graphs fit in the pool memory
    the larger ones reserved; only one graph replays at a time, so sharing is safe.
    """

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return CapturedStep(graph.replay, output)


class EagerReplay:
    """A stand-in for capture on machines without CUDA: it records ``fn`` and
    each replay runs it again eagerly, copying the result into the output it
    returned at "capture". Not a graph and not faster: it exists so tests on CPU
    exercise the same bucketing, static-buffer filling and padding logic that
    real replays read.
    """

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        output = fn()

        def replay() -> None:
            output.copy_(fn())

        return CapturedStep(replay, output)


class KernelGraphCapture:
    """CPU: the forward's kernel calls recorded once and replayed from C (``pagoda.cpp_extension.graph``).

    ``roots`` hold every tensor a recorded call may point into besides the capture's own (the
    model, the attention backend, the graph runner's static buffers and prepared metadata).
    """

    def __init__(self, roots: list[object]) -> None:
        self.roots = roots
        self.kernel_calls = 0
        self.torch_calls = 0
        self.kept_bytes = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        from pagoda.cpp_extension import graph as kernel_graph

        graph, output = kernel_graph.capture(fn, self.roots)
        self.kernel_calls += graph.num_kernel_calls
        self.torch_calls += graph.num_torch_calls
        self.kept_bytes += graph.own_bytes
        return CapturedStep(graph.replay, output)


def make_capturer(device: torch.device, roots: list[object] | None = None) -> Capturer | None:
    """The capture mechanism for ``device``; None where there is none (the runner stays eager)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGraphCapture()
    if device.type == "cpu":
        return KernelGraphCapture(roots or [])
    return None


def capture_sizes_for(platform: Platform, config: EngineConfig) -> list[int]:
    """Decode batch sizes to capture (ascending); [] turns graphs off.

    The platform owns the setting (``enforce_eager``, ``cuda_graph_sizes``); a
    platform without graphs captures nothing.
    """
    if not platform.supports_graphs:
        return []
    return sorted({int(s) for s in platform.cuda_graph_capture_sizes(config) if int(s) > 0})


class DecodeGraphRunner:
    """Static buffers plus one captured forward per decode batch size.

    ``replay`` takes the step's host arrays as the runner built them and returns
    the hidden states of the real rows, or None when the step must run eagerly.
    """

    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        prepare: Callable[[AttentionMetadata], AttentionMetadata],
        sizes: Sequence[int],
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        capturer: Capturer,
        pin_memory: bool = False,
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphRunner needs at least one capture size")
        self.model = model
        self.prepare = prepare
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        self.capturer = capturer
        m, w = self.max_size, max_blocks_per_req

        def dev(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)

        # Device buffers the graphs read; their addresses are baked into every graph.
        self.input_ids = dev((m,), torch.int64)
        self.positions = dev((m,), torch.int64)
        self.slot_mapping = dev((m,), torch.int64)
        self.seq_lens = dev((m,), torch.int32)
        self.block_tables = dev((m, w), torch.int32)
        # One new token per sequence: the offsets never change.
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        # Host staging, filled with numpy and copied up in one go per buffer.
        self._h_ids = host((m,), torch.int64)
        self._h_pos = host((m,), torch.int64)
        self._h_slots = host((m,), torch.int64)
        self._h_seq = host((m,), torch.int32)
        # Flat so a [N, w] prefix of it is contiguous whatever the step's w.
        self._h_bt = host((m * w,), torch.int32)
        # numpy views of the staging (shared memory), made once: .numpy() per step costs microseconds.
        self._n_ids, self._n_pos, self._n_slots, self._n_seq, self._n_bt = (
            t.numpy() for t in (self._h_ids, self._h_pos, self._h_slots, self._h_seq, self._h_bt)
        )
        # Pinned copies are asynchronous: the staging may be rewritten only once they are done.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.steps: dict[int, CapturedStep] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0
        # Set where the capture must wait (kernel graphs bake in the fp8 KV scales calculate_kv_scales
        # derives from the first step): the first pure-decode step after it returns True captures.
        self.capture_when: Callable[[], bool] | None = None
        self.off = False
        self.capture_bytes = 0

    # -- set-up ---------------------------------------------------------------
    def static_metadata(self, size: int) -> AttentionMetadata:
        """The metadata every replay of the ``size`` graph sees (views of the static buffers)."""
        md = AttentionMetadata(
            num_seqs=size, num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            # An upper bound: host-side choices made from it hold for any replay.
            max_seq_len=self.max_model_len,
            # Host copies would be stale at replay; graph-safe backends must not read them.
            query_start_loc_cpu=None, seq_lens_cpu=None,
            is_all_decode=True,
        )
        return self.prepare(md)

    def _reset_padding(self) -> None:
        """Every row a padding row: slot -1 (no KV write), seq_len 1 over the null block 0."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        free_before = _free_device_bytes(self.device)
        self._reset_padding()
        for size in reversed(self.sizes):
            md = self.static_metadata(size)
            ids, pos = self.input_ids[:size], self.positions[:size]

            def forward(ids: torch.Tensor = ids, pos: torch.Tensor = pos, md: AttentionMetadata = md) -> torch.Tensor:
                return self.model(ids, pos, md)

            # (a kernel graph's capture is itself a forward; the CPU kernels are built by then)
            for _ in range(0 if isinstance(self.capturer, KernelGraphCapture) else NUM_WARMUP_RUNS):
                forward()
            _synchronize(self.device)
            # before the capture: a kernel graph keeps what the prepared metadata holds alive through it
            self.metadata[size] = md
            self.steps[size] = self.capturer.capture(forward)
        _synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        free_after = _free_device_bytes(self.device)
        if isinstance(self.capturer, KernelGraphCapture):
            self.capture_bytes = self.capturer.kept_bytes
        else:
            self.capture_bytes = max(free_before - free_after, 0) if free_before is not None and free_after is not None else 0

    # -- per step -------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured size holding ``num_tokens`` rows, or None if none does."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) and num_tokens > 0 else None

    @torch.inference_mode()
    def replay(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure-decode step, or None: run it eagerly.

        The result is a view of the graph's static output, valid until the next replay.
        """
        n = len(input_ids)
        if len(num_scheduled) != n or not (num_scheduled == 1).all():
            return None
        if self.off or (self.capture_when is not None and not self._capture_deferred()):
            return None
        size = self.bucket(n)
        if size is None:
            return None
        w = block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        ids_h, pos_h, slots_h, seq_h = self._n_ids, self._n_pos, self._n_slots, self._n_seq
        bt_h = self._n_bt[: size * w].reshape(size, w)
        ids_h[:n] = input_ids
        ids_h[n:size] = 0
        pos_h[:n] = positions
        pos_h[n:size] = 0
        slots_h[:n] = slot_mapping
        slots_h[n:size] = PAD_SLOT
        seq_h[:n] = seq_lens
        seq_h[n:size] = 1
        bt_h[:n] = block_tables
        bt_h[n:size] = 0
        self.input_ids[:size].copy_(self._h_ids[:size], non_blocking=True)
        self.positions[:size].copy_(self._h_pos[:size], non_blocking=True)
        self.slot_mapping[:size].copy_(self._h_slots[:size], non_blocking=True)
        self.seq_lens[:size].copy_(self._h_seq[:size], non_blocking=True)
        # Columns past w keep stale ids: a row reads only the blocks its seq_len covers (<= w).
        self.block_tables[:size, :w].copy_(self._h_bt[: size * w].view(size, w), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        step = self.steps[size]
        step.replay()
        self.num_replays += 1
        return step.output[:n]

    def _capture_deferred(self) -> bool:
        """Capture now if the wait is over; False while it is not, or once a deferred capture failed."""
        from pagoda.cpp_extension.graph import NotCapturable

        assert self.capture_when is not None
        if not self.capture_when():
            return False
        self.capture_when = None
        try:
            self.capture()
        except NotCapturable as exc:
            logger.info("kernel graphs off, every step runs eagerly: %s", exc)
            self.off = True
            return False
        logger.info("%s", self.describe())
        return True

    def describe(self) -> str:
        mib = self.capture_bytes / (1 << 20)
        if isinstance(self.capturer, KernelGraphCapture):
            return (
                f"captured CPU kernel graphs for decode batch sizes {self.sizes} "
                f"in {self.capture_seconds:.2f}s: {self.capturer.kernel_calls} kernel calls and "
                f"{self.capturer.torch_calls} torch calls replayed, {mib:.1f} MiB of activations kept"
            )
        return (
            f"captured decode graphs for {len(self.sizes)} batch sizes ({self.sizes[0]}..{self.max_size}) "
            f"in {self.capture_seconds:.2f}s using {mib:.1f} MiB of device memory"
        )


def create_decode_graphs(runner: ModelRunner) -> DecodeGraphRunner | None:
    """Capture decode graphs for ``runner`` (after its KV cache is bound), or say why not and return None."""
    sizes = capture_sizes_for(runner.platform, runner.config)
    # A decode batch never exceeds these; larger graphs would never replay.
    limit = min(runner.max_num_seqs, runner.max_num_batched_tokens)
    sizes = [s for s in sizes if s <= limit]
    kind = "CUDA graphs" if runner.device.type == "cuda" else "kernel graphs"
    if not sizes:
        if runner.platform.supports_graphs:
            logger.info("%s off (enforce_eager or no capture sizes): every step runs eagerly", kind)
        return None
    # A model class opts out with pagoda.models.interface.NoCudaGraphs: pagoda.layers.FusedMoE reads its
    # per-expert token counts on the host, which a graph cannot capture.
    if not supports_cuda_graphs(runner.model):
        logger.info("%s off: model %s does not support them", kind, type(runner.model).__name__)
        return None
    backend = runner.attn_backend
    capturer = make_capturer(runner.device, [runner.model, backend])
    if capturer is None:
        logger.info("%s off: no graph runtime for device %s", kind, runner.device)
        return None
    kernel_graphs = isinstance(capturer, KernelGraphCapture)
    if not (backend.supports_kernel_graphs if kernel_graphs else backend.supports_cuda_graphs):
        logger.info("%s off: attention backend %r does not support them", kind, type(backend).name)
        return None
    if kernel_graphs and get_tensor_model_parallel_world_size() > 1:
        # a collective between ranks is not a recorded kernel call
        logger.info("kernel graphs off: tensor parallelism")
        return None
    return build_decode_graphs(runner, sizes, capturer)


def build_decode_graphs(runner: ModelRunner, sizes: Sequence[int], capturer: Capturer) -> DecodeGraphRunner | None:
    pin = runner.device.type == "cuda" and runner.platform.is_pin_memory_available(runner.config)
    graphs = DecodeGraphRunner(
        runner.model, runner.attn_backend.prepare, sizes, runner.batch.block_table.shape[1], runner.max_model_len,
        runner.device, capturer, pin_memory=pin,
    )
    if isinstance(capturer, KernelGraphCapture):
        from pagoda.cpp_extension.graph import NotCapturable

        capturer.roots.append(graphs)  # its static buffers and prepared metadata
        if runner.config.cache_config.calculate_kv_scales:
            # the kernels take the fp8 scales as values: capture once the first step has derived them
            graphs.capture_when = lambda: not any(layer.calculate_kv_scales for layer in runner.attn_layers)
            logger.info("CPU kernel graphs captured after the first step (calculate_kv_scales)")
            return graphs
        try:
            graphs.capture()
        except NotCapturable as exc:
            logger.info("kernel graphs off, every step runs eagerly: %s", exc)
            return None
    else:
        graphs.capture()
    logger.info("%s", graphs.describe())
    return graphs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])
