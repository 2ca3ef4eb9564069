"""The linear method both formats share: the checkpoint's tensors in, one of three kernels out.

Where the layer lives decides the kernel: on CPU the C++ kernel (``cpu_kernel``, 4-bit; the torch
reference for 8-bit GPTQ, where it cannot be built, or with ``PAGODA_INT4_KERNEL=0``), on a CUDA /
ROCm device the Triton kernel (``triton_kernel``), anywhere else the torch reference
(``formats.dequantize`` per call).

A fused layer (q/k/v, gate/up) receives one tensor per checkpoint layer (``shard_id``); they are
concatenated along the output channels. Act-order GPTQ layers whose parts carry different
``g_idx`` (each projection was ordered by its own statistics) keep one kernel per part.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quantization import LinearMethodBase
from pagoda_quant_gptq_awq import cpu_kernel
from pagoda_quant_gptq_awq.formats import Format, PackedCheckpoint, dequantize, group_index, unpack

TENSORS: dict[str, tuple[str, ...]] = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
                                       "awq": ("qweight", "qzeros", "scales")}


def _collect(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
    """Keeps one checkpoint tensor under its shard (a fused layer gets one per checkpoint layer)."""
    param.shards[0 if shard_id is None else shard_id] = loaded  # type: ignore[attr-defined]


def kernel_for(device: torch.device, bits: int = 4) -> str:
    """"cpu", "triton" or "torch": the kernel a ``bits``-bit layer on ``device`` runs."""
    if device.type == "cpu":
        # the C++ kernel packs nibbles: 8-bit GPTQ runs the reference on CPU
        return "cpu" if bits == 4 and cpu_kernel.library() is not None else "torch"
    if device.type == "cuda":  # ROCm's devices are "cuda" to torch as well
        return "triton"
    return "torch"


class _Part:
    """Output channels [start, start + N) of a layer and the kernel that computes them."""

    def __init__(self, ckpt: PackedCheckpoint, kernel: str) -> None:
        self.kernel = kernel
        self.out_features = ckpt.out_features
        self.ckpt: PackedCheckpoint | None = ckpt
        self.cpu: cpu_kernel.CpuInt4Weight | None = None
        self.lib: ModuleType | None = None
        if kernel == "cpu":
            self.lib = cpu_kernel.library()
            assert self.lib is not None
            q, zeros, scales = unpack(ckpt)
            self.cpu = cpu_kernel.CpuInt4Weight.prepare(q, zeros, scales, group_index(ckpt), self.lib)
            self.ckpt = None  # the repacked copy is all the kernel reads

    def held(self) -> list[torch.Tensor]:
        """The tensors the kernel reads (the layer's memory)."""
        if self.cpu is not None:
            return [self.cpu.packed, self.cpu.scales, self.cpu.szeros]
        assert self.ckpt is not None
        return [t for t in (self.ckpt.qweight, self.ckpt.qzeros, self.ckpt.scales, self.ckpt.g_idx) if t is not None]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.cpu is not None:
            assert self.lib is not None
            return self.cpu.matmul(x, bias, self.lib)
        assert self.ckpt is not None
        if self.kernel == "triton":
            from pagoda_quant_gptq_awq import triton_kernel

            return triton_kernel.matmul(x, self.ckpt, bias)
        return F.linear(x.float(), dequantize(self.ckpt), None if bias is None else bias.float())


class Int4LinearMethod(LinearMethodBase):
    """A 4-bit GPTQ or AWQ ``Linear`` (or an 8-bit GPTQ one)."""

    def __init__(self, fmt: Format, group_size: int, zero_offset: int, bits: int = 4) -> None:
        self.format = fmt
        self.bits = bits
        self.group_size = group_size  # -1: one group over all input channels
        self.zero_offset = zero_offset
        self.parts: list[tuple[int, _Part]] = []

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],  # type: ignore[override]
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        self.in_features = input_size_per_partition
        self.out_features = sum(output_partition_sizes)
        # the float weight was created on the model's device (never touched): the kernel runs there
        weight = layer.weight
        self.device: torch.device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        layer.register_parameter("weight", None)
        for name in TENSORS[self.format]:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = _collect  # type: ignore[attr-defined]
            param.shards = {}  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def _shards(self, layer: nn.Module, name: str) -> list[torch.Tensor]:
        shards: dict[int, torch.Tensor] = getattr(layer, name).shards
        return [shards[i] for i in sorted(shards)]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tensors = {name: self._shards(layer, name) for name in TENSORS[self.format]}
        counts = {name: len(parts) for name, parts in tensors.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"{self.format} layer: the checkpoint holds {counts} tensors per part")
        group_size = self.group_size if self.group_size != -1 else self.in_features
        kernel = kernel_for(self.device, self.bits)
        pieces: list[PackedCheckpoint] = []
        for i in range(counts["qweight"]):
            scales = tensors["scales"][i]
            piece = PackedCheckpoint(self.format, tensors["qweight"][i].to(self.device), tensors["qzeros"][i].to(self.device),
                                   scales.to(self.device),
                                   tensors["g_idx"][i].to(self.device) if self.format == "gptq" else None,
                                   group_size, self.zero_offset, self.in_features, int(scales.shape[-1]), self.bits)
            piece.validate(f"{self.format} part {i}")
            pieces.append(piece)
        if sum(p.out_features for p in pieces) != self.out_features:
            raise ValueError(f"{self.format} layer: the checkpoint's parts hold {[p.out_features for p in pieces]} "
                             f"output channels, the layer has {self.out_features}")
        # runs of parts that share their g_idx (always, without act order) become one concatenated weight
        runs: list[list[PackedCheckpoint]] = []
        for piece in pieces:
            if runs and _same_groups(runs[-1][0], piece):
                runs[-1].append(piece)
            else:
                runs.append([piece])
        self.parts = []
        start = 0
        for run in runs:
            merged = _concat(run)
            self.parts.append((start, _Part(merged, kernel)))
            start += merged.out_features
        for name in TENSORS[self.format]:
            delattr(layer, name)
            layer.register_parameter(name, None)
        # what the kernels read is the layer's memory now (parameters: counted and moved with the model)
        for index, (_, part) in enumerate(self.parts):
            for j, tensor in enumerate(part.held()):
                layer.register_parameter(f"int4_{index}_{j}", nn.Parameter(tensor, requires_grad=False))
        self.kernel = kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        assert self.parts, "process_weights_after_loading has not run"
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if len(self.parts) == 1:
            y = self.parts[0][1].matmul(x2, bias)
        else:
            y = torch.cat([part.matmul(x2, None if bias is None else bias[start:start + part.out_features])
                           for start, part in self.parts], dim=1)
        return y.to(x.dtype).reshape(*lead, self.out_features)


def _same_groups(a: PackedCheckpoint, b: PackedCheckpoint) -> bool:
    if a.g_idx is None or b.g_idx is None:
        return a.g_idx is None and b.g_idx is None
    return bool(torch.equal(a.g_idx, b.g_idx))


def _concat(run: list[PackedCheckpoint]) -> PackedCheckpoint:
    """Parts of one fused layer along N: every tensor is N-major in its last dimension."""
    if len(run) == 1:
        return run[0]
    first = run[0]
    return PackedCheckpoint(first.format, torch.cat([p.qweight for p in run], dim=1),
                          torch.cat([p.qzeros for p in run], dim=1), torch.cat([p.scales for p in run], dim=1),
                          first.g_idx, first.group_size, first.zero_offset, first.in_features,
                          sum(p.out_features for p in run), first.bits)
