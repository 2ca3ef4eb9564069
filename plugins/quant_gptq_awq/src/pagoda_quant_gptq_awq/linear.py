"""The linear method both formats share: the checkpoint's tensors in, one of three kernels out.

Where the layer lives decides the kernel: on CPU the C++ kernels (``cpu_kernel`` 4-bit, ``cpu_int8_kernel``
8-bit GPTQ; the torch reference where they cannot be built, or with ``PAGODA_INT4_KERNEL=0`` /
``PAGODA_GPTQ8_KERNEL=0``), on a CUDA /
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

from pagoda.layers.parallel_linear import check_input_split, input_split, shard_input, shard_output
from pagoda.quantization import LinearMethodBase
from pagoda_quant_gptq_awq import cpu_int8_kernel, cpu_kernel
from pagoda_quant_gptq_awq.formats import Format, PackedCheckpoint, dequantize, group_index, unpack

TENSORS: dict[str, tuple[str, ...]] = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
                                       "awq": ("qweight", "qzeros", "scales")}


def _collector(layer: nn.Module, name: str, method: Int4LinearMethod) -> Any:
    """The ``weight_loader`` of ``layer``'s tensor ``name``: keeps this tensor-parallel rank's slice of each
    checkpoint tensor under its shard (a fused layer gets one per checkpoint layer).

    Column-parallel: the output columns of qweight, qzeros (packed along N) and scales; g_idx whole.
    Row-parallel: qweight's input rows (GPTQ packs them 32 / bits to an int32), whole groups of scales
    and qzeros with g_idx's slice renumbered from the rank's first group; an act-order layer keeps every
    group (its g_idx, sliced, names them in any order), as does a layer of one group (group_size -1).
    """
    fmt, pf = method.format, 32 // method.bits
    what = f"{fmt} {name}"
    grouped_rows = method.group_size != -1 and not method.act_order

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        part = loaded
        if name == "qweight":
            part = shard_output(layer, part, shard_id, dim=1, pack_factor=pf if fmt == "awq" else 1, what=what)
            part = shard_input(layer, part, dim=0, unit=pf if fmt == "gptq" else 1, what=what)
        elif name in ("qzeros", "scales"):
            part = shard_output(layer, part, shard_id, dim=1, pack_factor=pf if name == "qzeros" else 1, what=what)
            if grouped_rows:
                part = shard_input(layer, part, dim=0, unit=method.group_size, what=what)
        else:  # g_idx: the group of each input feature
            part = shard_input(layer, part, dim=0, what=what)
            if grouped_rows and input_split(layer):
                part = part - layer.tp_rank * (method.in_features // method.group_size)
        param.shards[0 if shard_id is None else shard_id] = part  # type: ignore[attr-defined]

    return load


def kernel_for(device: torch.device, bits: int = 4) -> str:
    """"cpu", "triton" or "torch": the kernel a ``bits``-bit layer on ``device`` runs."""
    if device.type == "cpu":
        lib = cpu_kernel.library() if bits == 4 else cpu_int8_kernel.library()
        return "cpu" if lib is not None else "torch"
    if device.type == "cuda":  # ROCm's devices are "cuda" to torch as well
        return "triton"
    return "torch"


class _Part:
    """Output channels [start, start + N) of a layer and the kernel that computes them."""

    def __init__(self, ckpt: PackedCheckpoint, kernel: str) -> None:
        self.kernel = kernel
        self.out_features = ckpt.out_features
        self.ckpt: PackedCheckpoint | None = ckpt
        self.cpu: cpu_kernel.CpuInt4Weight | cpu_int8_kernel.CpuInt8Weight | None = None
        self.lib: ModuleType | None = None
        if kernel == "cpu":
            q, zeros, scales = unpack(ckpt)
            if ckpt.bits == 8:
                self.lib = cpu_int8_kernel.library()
                assert self.lib is not None
                self.cpu = cpu_int8_kernel.CpuInt8Weight.prepare(q, zeros, scales, group_index(ckpt), self.lib)
            else:
                self.lib = cpu_kernel.library()
                assert self.lib is not None
                self.cpu = cpu_kernel.CpuInt4Weight.prepare(q, zeros, scales, group_index(ckpt), self.lib)
            self.ckpt = None  # the repacked copy is all the kernel reads

    def held(self) -> list[torch.Tensor]:
        """The tensors the kernel reads (the layer's memory)."""
        if isinstance(self.cpu, cpu_int8_kernel.CpuInt8Weight):
            return [self.cpu.packed, self.cpu.scales, self.cpu.zeros, self.cpu.gstart, self.cpu.gpad]
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

    def __init__(self, fmt: Format, group_size: int, zero_offset: int, bits: int = 4, act_order: bool = False) -> None:
        self.format = fmt
        self.bits = bits
        self.act_order = act_order  # GPTQ desc_act: g_idx orders the groups
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
        if self.format == "gptq":
            check_input_split(layer, 32 // self.bits, f"gptq qweight ({32 // self.bits} input features to an int32)")
        if self.group_size != -1 and not self.act_order:
            check_input_split(layer, self.group_size, f"{self.format} groups of {self.group_size}")
        for name in TENSORS[self.format]:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = _collector(layer, name, self)  # type: ignore[attr-defined]
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
                                   group_size, self.zero_offset, self.in_features, int(scales.shape[-1]), self.bits,
                                   int(scales.shape[0]) if self.act_order and input_split(layer) else None)
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
                          sum(p.out_features for p in run), first.bits, first.groups)
