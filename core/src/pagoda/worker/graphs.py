"""Graph capture and replay of the model's forward pass for pure-decode steps: CUDA graphs on a GPU,
kernel graphs (``pagoda.cpp_extension.graph``) on CPU.

A decode step of ``n`` requests runs the same kernels for every ``n`` of a
given size, with only data changing. On a GPU the runner captures one graph at
start-up per capture size ``N`` (largest first, all in one memory pool) over static
device buffers; a decode step with ``n <= max(N)`` is then padded up to the
next captured size, its inputs are copied into the static buffers and the
graph is replayed, which saves the per-kernel launch cost that dominates small
decode batches on a GPU.

On CPU the capture is a kernel graph (``pagoda.cpp_extension.graph``: the forward's
kernel calls recorded and replayed from C); its capture is itself one forward, so it
needs no warm-up runs, and each size is captured on its first decode step instead of at
start-up (``captures_on_first_use``): a server that never decodes 24 rows at once never
captures that size, and start-up captures nothing. The first decode always follows a prefill,
so lazily built tables (RoPE cos/sin) exist by then and are not recorded. A forward that
cannot be captured leaves that engine eager. Which capturer a device has is the platform's
answer (``Platform.graph_capturer``).

Padding rows carry slot -1 (the KV-write kernels skip negative slots, so they
write nothing), token 0 at position 0, and seq_len 1 over block 0, the
engine's reserved null block (never handed out). Every layer treats rows
independently, so padding never changes a real row's result; the runner reads
only the first ``n`` rows of the static output.

Speculative verify steps (every request ``q = 1 + drafts`` rows) replay graphs too where the capturer
captures on first use and the attention backend declares ``supports_uniform_batch_graphs`` (vLLM's
AttentionCGSupport.UNIFORM_BATCH): one graph per (batch size, q), captured on the first step of that
shape, with ``q`` up to ``max_query_len`` (1 + num_speculative_tokens). Their padding requests carry q
rows at slot -1 over block 0 with seq_len q + 1. A step whose requests have different query lengths
(drafts of different lengths in one batch) runs eagerly.

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
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from pagoda.attention import AttentionMetadata
from pagoda.distributed import get_tensor_model_parallel_world_size
from pagoda.models.interface import supports_cuda_graphs

if TYPE_CHECKING:
    from pagoda.attention import AttentionBackend
    from pagoda.config import EngineConfig
    from pagoda.platforms import Platform

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


class GraphCapturer:
    """How a platform records a forward once and replays it (``Platform.graph_capturer`` returns one).

    ``capture(fn)`` runs ``fn`` under the recording and returns the step that replays it. The other
    methods say what the graph runner must do around captures on this device; the defaults are a
    host's (nothing to wait for, no device memory to watch, no asynchronous copies).
    """

    # the name in the start-up log
    kind: ClassVar[str] = "decode graphs"
    # warm-up forwards before each capture (compiles, lazily built tables)
    warmup_runs: ClassVar[int] = 0
    # True: each size is captured on its first replay instead of all of them at start-up
    captures_on_first_use: ClassVar[bool] = False
    # True: the recorded kernels take the fp8 KV scales as values, so with calculate_kv_scales nothing is
    # captured before the first step has derived them
    bakes_in_kv_scales: ClassVar[bool] = False

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        raise NotImplementedError

    def unsupported_reason(self, backend: AttentionBackend) -> str | None:
        """Why graphs cannot run over ``backend`` (or with this engine's layout), or None."""
        if type(backend).supports_cuda_graphs:
            return None
        return f"attention backend {type(backend).name!r} does not support them"

    def synchronize(self) -> None:
        """Wait for the captured work (a device's queue) before timing or reading memory."""

    def free_device_bytes(self) -> int | None:
        """Free device memory, to report what the graphs took; None where there is no device memory."""
        return None

    def copy_done_event(self) -> Any:
        """An event recorded after each replay's input copies (pinned copies are asynchronous), or None."""
        return None

    def kept_bytes(self) -> int | None:
        """Bytes the captured graphs keep alive, where the capturer counts them itself."""
        return None

    def release(self) -> None:
        """Forget what the captures were made over (the graph runner is dropping its graphs)."""


class CudaGraphCapture(GraphCapturer):
    """Real capture: ``torch.cuda.CUDAGraph`` per size, one memory pool shared by all of them.

    Sizes are captured largest first so the smaller graphs fit in the pool memory
    the larger ones reserved; only one graph replays at a time, so sharing is safe.
    """

    kind = "CUDA graphs"
    warmup_runs = NUM_WARMUP_RUNS

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return CapturedStep(graph.replay, output)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def free_device_bytes(self) -> int | None:
        return int(torch.cuda.mem_get_info()[0])

    def copy_done_event(self) -> Any:
        return torch.cuda.Event()


class EagerReplay(GraphCapturer):
    """A stand-in for capture on machines without CUDA: it records ``fn`` and
    each replay runs it again eagerly, copying the result into the output it
    returned at "capture". Not a graph and not faster: it exists so tests on CPU
    exercise the same bucketing, static-buffer filling and padding logic that
    real replays read.
    """

    warmup_runs = NUM_WARMUP_RUNS

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        output = fn()

        def replay() -> None:
            output.copy_(fn())

        return CapturedStep(replay, output)


class KernelGraphCapture(GraphCapturer):
    """CPU: the forward's kernel calls recorded once and replayed from C (``pagoda.cpp_extension.graph``).

    ``roots`` hold every tensor a recorded call may point into besides the capture's own (the
    model, the attention backend, the graph runner's static buffers and prepared metadata).
    """

    kind = "kernel graphs"
    # the capture is itself a forward, and the first decode follows a prefill that built every lazy table
    captures_on_first_use = True
    bakes_in_kv_scales = True

    def __init__(self, roots: list[object]) -> None:
        self.roots = roots
        self.kernel_calls = 0
        self.torch_calls = 0
        self.own_bytes = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        from pagoda.cpp_extension import graph as kernel_graph

        graph, output = kernel_graph.capture(fn, self.roots)
        self.kernel_calls += graph.num_kernel_calls
        self.torch_calls += graph.num_torch_calls
        self.own_bytes += graph.own_bytes
        return CapturedStep(graph.replay, output)

    def unsupported_reason(self, backend: AttentionBackend) -> str | None:
        if not type(backend).supports_kernel_graphs:
            return f"attention backend {type(backend).name!r} does not support them"
        if get_tensor_model_parallel_world_size() > 1:
            return "tensor parallelism (a collective between ranks is not a recorded kernel call)"
        return None

    def kept_bytes(self) -> int | None:
        return self.own_bytes

    def release(self) -> None:
        self.roots.clear()


@dataclass(frozen=True)
class GraphInputs:
    """What decode graphs are built over: the model and its bound attention, and the batch's limits."""

    model: Any
    attn_backend: AttentionBackend
    attn_layers: Sequence[Any]
    max_blocks_per_req: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device: torch.device
    # the longest uniform query length a step may replay (1 + num_speculative_tokens; 1: decode only)
    max_query_len: int = 1


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
        capturer: GraphCapturer,
        pin_memory: bool = False,
        max_query_len: int = 1,
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
        self.max_query_len = max(1, max_query_len)
        m, w = self.max_size, max_blocks_per_req
        # token rows: a verify step of m requests has up to m * max_query_len of them
        t = m * self.max_query_len

        def dev(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)

        # Device buffers the graphs read; their addresses are baked into every graph.
        self.input_ids = dev((t,), torch.int64)
        self.positions = dev((t,), torch.int64)
        self.slot_mapping = dev((t,), torch.int64)
        self.seq_lens = dev((m,), torch.int32)
        self.block_tables = dev((m, w), torch.int32)
        # One new token per sequence: the offsets never change.
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        # Host staging, filled with numpy and copied up in one go per buffer.
        self._h_ids = host((t,), torch.int64)
        self._h_pos = host((t,), torch.int64)
        self._h_slots = host((t,), torch.int64)
        self._h_seq = host((m,), torch.int32)
        # Flat so a [N, w] prefix of it is contiguous whatever the step's w.
        self._h_bt = host((m * w,), torch.int32)
        # numpy views of the staging (shared memory), made once: .numpy() per step costs microseconds.
        self._n_ids, self._n_pos, self._n_slots, self._n_seq, self._n_bt = (
            t.numpy() for t in (self._h_ids, self._h_pos, self._h_slots, self._h_seq, self._h_bt)
        )
        # Pinned copies are asynchronous: the staging may be rewritten only once they are done.
        self._copied = capturer.copy_done_event()
        self.steps: dict[int, CapturedStep] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        # verify steps, keyed (batch size, q): the graphs and their metadata (whose query_start_loc,
        # arange(size + 1) * q, each keeps alive)
        self.verify_steps: dict[tuple[int, int], CapturedStep] = {}
        self.verify_metadata: dict[tuple[int, int], AttentionMetadata] = {}
        self.num_verify_replays = 0
        self.num_replays = 0
        self.capture_seconds = 0.0
        # Set where the capture must wait (kernel graphs bake in the fp8 KV scales calculate_kv_scales
        # derives from the first step): no size is captured, and every step runs eagerly, until it returns True.
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

    def verify_metadata_for(self, size: int, q: int) -> AttentionMetadata:
        """The metadata every replay of the (``size`` requests x ``q`` rows) verify graph sees."""
        md = AttentionMetadata(
            num_seqs=size, num_tokens=size * q,
            query_start_loc=torch.arange(0, (size + 1) * q, q, dtype=torch.int32, device=self.device),
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[: size * q],
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=None, seq_lens_cpu=None,
        )
        return self.prepare(md)

    def _reset_padding(self, q: int = 1) -> None:
        """Every row a padding row: slot -1 (no KV write), seq_len 1 over the null block 0 (q + 1 for a
        request of q > 1 rows: no sequence of a verify graph is a whole prompt, as no real one is)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        self.seq_lens.fill_(1 if q == 1 else q + 1)
        self.block_tables.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size now, largest first (a CUDA graph pool is sized by the first capture)."""
        for size in reversed(self.sizes):
            self.capture_size(size)

    @torch.inference_mode()
    def capture_size(self, size: int) -> None:
        """Capture the ``size`` graph over padding rows (its forward writes no KV: every slot is -1)."""
        self._capture(size, 1)

    @torch.inference_mode()
    def _capture(self, size: int, q: int) -> None:
        """Capture ``size`` requests of ``q`` rows each (q = 1: a decode graph, else a verify graph)."""
        t0 = time.perf_counter()
        free_before = self.capturer.free_device_bytes()
        self._reset_padding(q)
        md = self.static_metadata(size) if q == 1 else self.verify_metadata_for(size, q)
        ids, pos = self.input_ids[: size * q], self.positions[: size * q]

        def forward(ids: torch.Tensor = ids, pos: torch.Tensor = pos, md: AttentionMetadata = md) -> torch.Tensor:
            return self.model(ids, pos, md)

        for _ in range(self.capturer.warmup_runs):
            forward()
        self.capturer.synchronize()
        # before the capture: a kernel graph keeps what the prepared metadata holds alive through it
        if q == 1:
            self.metadata[size] = md
            self.steps[size] = self.capturer.capture(forward)
        else:
            self.verify_metadata[size, q] = md
            self.verify_steps[size, q] = self.capturer.capture(forward)
        self.capturer.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        kept = self.capturer.kept_bytes()
        free_after = self.capturer.free_device_bytes()
        if kept is not None:
            self.capture_bytes = kept
        elif free_before is not None and free_after is not None:
            self.capture_bytes += max(free_before - free_after, 0)

    def release(self) -> None:
        """Drop every captured graph and what it keeps alive (the KV cache among it), now.

        The runner, its capturer (whose roots name the runner) and each graph's closures form reference
        cycles, which only a collection frees -- and in an engine-core process the start-up heap is frozen
        out of the collector (``core_proc``), so sleep would keep the whole KV cache mapped. Cutting the
        references lets reference counting free it.
        """
        self.steps.clear()
        self.metadata.clear()
        self.verify_steps.clear()
        self.verify_metadata.clear()
        self.capturer.release()

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
        """Hidden states [n, hidden] of a pure-decode step (or a uniform verify step: every request the same
        q rows, q <= ``max_query_len``), or None: run it eagerly.

        The result is a view of the graph's static output, valid until the next replay.
        """
        n, r = len(input_ids), len(num_scheduled)
        if not r:
            return None
        q = int(num_scheduled[0])
        if q < 1 or q > self.max_query_len or n != r * q or not (num_scheduled == q).all():
            return None
        if self.off or (self.capture_when is not None and not self._wait_over()):
            return None
        size = self.bucket(r)
        if size is None:
            return None
        w = block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            return None
        steps = self.steps if q == 1 else self.verify_steps
        key: Any = size if q == 1 else (size, q)
        if key not in steps and not self._capture_on_first_use(size, q):
            return None
        if self._copied is not None:
            self._copied.synchronize()
        rows = size * q
        ids_h, pos_h, slots_h, seq_h = self._n_ids, self._n_pos, self._n_slots, self._n_seq
        bt_h = self._n_bt[: size * w].reshape(size, w)
        ids_h[:n] = input_ids
        ids_h[n:rows] = 0
        pos_h[:n] = positions
        pos_h[n:rows] = 0
        slots_h[:n] = slot_mapping
        slots_h[n:rows] = PAD_SLOT
        seq_h[:r] = seq_lens
        seq_h[r:size] = 1 if q == 1 else q + 1
        bt_h[:r] = block_tables
        bt_h[r:size] = 0
        self.input_ids[:rows].copy_(self._h_ids[:rows], non_blocking=True)
        self.positions[:rows].copy_(self._h_pos[:rows], non_blocking=True)
        self.slot_mapping[:rows].copy_(self._h_slots[:rows], non_blocking=True)
        self.seq_lens[:size].copy_(self._h_seq[:size], non_blocking=True)
        # Columns past w keep stale ids: a row reads only the blocks its seq_len covers (<= w).
        self.block_tables[:size, :w].copy_(self._h_bt[: size * w].view(size, w), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        step = steps[key]
        step.replay()
        if q == 1:
            self.num_replays += 1
        else:
            self.num_verify_replays += 1
        return step.output[:n]

    def _wait_over(self) -> bool:
        """True once ``capture_when`` holds (then it is dropped); an eager capturer captures every size then."""
        assert self.capture_when is not None
        if not self.capture_when():
            return False
        self.capture_when = None
        if self.capturer.captures_on_first_use:
            return True
        self.capture()
        logger.info("%s", self.describe())
        return True

    def _capture_on_first_use(self, size: int, q: int = 1) -> bool:
        """Capture ``size`` (x ``q`` rows) for the step about to replay it; False (graphs off for good) when it
        cannot be captured. Only a capturer that captures on first use has verify graphs (``max_query_len`` > 1)."""
        from pagoda.cpp_extension.graph import NotCapturable

        try:
            self._capture(size, q)
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
                f"captured CPU kernel graphs for decode batch sizes {sorted(self.steps)} of {self.sizes}"
                f"{self._describe_verify()} "
                f"in {self.capture_seconds:.2f}s: {self.capturer.kernel_calls} kernel calls and "
                f"{self.capturer.torch_calls} torch calls replayed, {mib:.1f} MiB of activations kept"
            )
        return (
            f"captured decode graphs for {len(self.sizes)} batch sizes ({self.sizes[0]}..{self.max_size}) "
            f"in {self.capture_seconds:.2f}s using {mib:.1f} MiB of device memory"
        )


    def _describe_verify(self) -> str:
        if not self.verify_steps:
            return ""
        shapes = ", ".join(f"{size}x{q}" for size, q in sorted(self.verify_steps))
        return f" and verify steps (requests x rows) {shapes}"


def create_decode_graphs(platform: Platform, config: EngineConfig, inputs: GraphInputs) -> DecodeGraphRunner | None:
    """Decode graphs over ``inputs`` (after the KV cache is bound), or say why not and return None."""
    sizes = capture_sizes_for(platform, config)
    # A decode batch never exceeds these; larger graphs would never replay.
    limit = min(inputs.max_num_seqs, inputs.max_num_batched_tokens)
    sizes = [s for s in sizes if s <= limit]
    if not sizes:
        if platform.supports_graphs:
            logger.info("decode graphs off (enforce_eager or no capture sizes): every step runs eagerly")
        return None
    capturer, why_not = platform.graph_capturer([inputs.model, inputs.attn_backend])
    if capturer is None:
        logger.info("decode graphs off: %s", why_not)
        return None
    kind = capturer.kind
    # A model class opts out with pagoda.models.interface.NoCudaGraphs: pagoda.layers.FusedMoE reads its
    # per-expert token counts on the host, which a graph cannot capture.
    if not supports_cuda_graphs(inputs.model):
        logger.info("%s off: model %s does not support them", kind, type(inputs.model).__name__)
        return None
    unsupported = capturer.unsupported_reason(inputs.attn_backend)
    if unsupported is not None:
        logger.info("%s off: %s", kind, unsupported)
        return None
    return build_decode_graphs(platform, config, inputs, sizes, capturer)


def verify_query_len(inputs: GraphInputs, capturer: GraphCapturer) -> int:
    """The longest verify step graphs replay: 1 (none) unless the capturer captures each shape on its first
    use (a verify shape per (size, q) captured at start-up would cost k times the decode graphs' capture)
    and the attention backend declares uniform-batch graphs."""
    if inputs.max_query_len <= 1 or not capturer.captures_on_first_use:
        return 1
    if not type(inputs.attn_backend).supports_uniform_batch_graphs:
        logger.info("speculative verify steps run eagerly: attention backend %r does not support uniform-batch graphs",
                    type(inputs.attn_backend).name)
        return 1
    return inputs.max_query_len


def build_decode_graphs(platform: Platform, config: EngineConfig, inputs: GraphInputs, sizes: Sequence[int],
                        capturer: GraphCapturer) -> DecodeGraphRunner | None:
    graphs = DecodeGraphRunner(
        inputs.model, inputs.attn_backend.prepare, sizes, inputs.max_blocks_per_req, inputs.max_model_len,
        inputs.device, capturer, pin_memory=platform.is_pin_memory_available(config),
        max_query_len=verify_query_len(inputs, capturer),
    )
    if isinstance(capturer, KernelGraphCapture):
        capturer.roots.append(graphs)  # its static buffers and prepared metadata
    if capturer.bakes_in_kv_scales and config.cache_config.calculate_kv_scales:
        # the kernels take the fp8 scales as values: capture once the first step has derived them
        layers = inputs.attn_layers
        graphs.capture_when = lambda: not any(layer.calculate_kv_scales for layer in layers)
        logger.info("%s captured after the first step (calculate_kv_scales)", capturer.kind)
        return graphs
    if capturer.captures_on_first_use:
        logger.info("%s for decode batch sizes %s: each captured on its first decode step", capturer.kind, graphs.sizes)
        return graphs
    from pagoda.cpp_extension.graph import NotCapturable

    try:
        graphs.capture()
    except NotCapturable as exc:
        logger.info("%s off, every step runs eagerly: %s", capturer.kind, exc)
        return None
    logger.info("%s", graphs.describe())
    return graphs
