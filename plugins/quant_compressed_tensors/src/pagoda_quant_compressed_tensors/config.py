"""The ``compressed-tensors`` method: int8 checkpoints as the compressed-tensors library writes them.

Read from ``config.json``'s ``quantization_config`` (``quant_method: compressed-tensors``):
each of ``config_groups`` names target layers (``Linear``, a layer name or ``re:`` pattern) and
a scheme; ``ignore`` lists layers kept in float. Served here:

* W8A8: int8 weights, symmetric, one scale per output channel (``strategy: channel``, or one per
  tensor), activations quantized per token at run time (``input_activations``: int8, symmetric,
  ``dynamic: true``, ``strategy: token``), as vLLM's ``CompressedTensorsW8A8Int8`` runs it;
* W8A16: int8 weights, symmetric, per channel or per group (``group_size``), float activations.

Formats ``int-quantized`` / ``naive-quantized`` (``weight`` int8) and ``pack-quantized`` (8-bit
values four to an int32, ``weight_packed`` + ``weight_shape``). Anything else in the config
(asymmetric weights, static activation scales, 4-bit, fp8 weights, sparsity, transforms) is
refused with the reason, never loaded half-right. A ``kv_cache_scheme`` (fp8, static per-tensor)
is accepted, alone or beside int8 groups: its ``k_scale`` / ``v_scale`` tensors are read by core's
loader and used under an fp8 ``kv_cache_dtype``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.layers.parallel_linear import check_input_split, input_split, output_split, shard_input, shard_output
from pagoda.quantization import LinearMethodBase, QuantizationConfig, QuantizeMethodBase
from pagoda_quant_compressed_tensors import kernels

INT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class Scheme:
    """One config group's scheme, as far as the kernels read it."""

    targets: tuple[str, ...]
    strategy: str  # "channel", "tensor" or "group"
    group_size: int | None
    dynamic_activations: bool  # W8A8 (True) or W8A16 (False)
    format: str

    @property
    def name(self) -> str:
        return "W8A8" if self.dynamic_activations else "W8A16"


def _refuse(group: str, what: str) -> ValueError:
    return ValueError(f"compressed-tensors config group {group!r}: {what} is not supported by pagoda-quant-compressed-tensors "
                      "(it serves int8 W8A8 with dynamic per-token activations and W8A16, symmetric)")


def _parse_group(name: str, group: dict[str, Any], default_format: str | None) -> Scheme:
    weights = group.get("weights")
    if not weights:
        raise _refuse(name, "a group without weights")
    if weights.get("type", "int") != "int" or int(weights.get("num_bits", 0)) != 8:
        raise _refuse(name, f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
    if not weights.get("symmetric", True):
        raise _refuse(name, "asymmetric weights (zero points)")
    if weights.get("dynamic", False):
        raise _refuse(name, "dynamic weight quantization")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("channel", "tensor", "group"):
        raise _refuse(name, f"weight strategy {strategy!r}")
    if weights.get("actorder"):
        raise _refuse(name, f"activation ordering ({weights['actorder']})")
    group_size = weights.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise _refuse(name, f"group strategy without a positive group_size ({group_size})")
    acts = group.get("input_activations")
    if acts:
        if acts.get("type", "int") != "int" or int(acts.get("num_bits", 0)) != 8:
            raise _refuse(name, f"{acts.get('num_bits')}-bit {acts.get('type')} activations")
        if not acts.get("dynamic", False):
            raise _refuse(name, "static activation scales (input_scale)")
        if not acts.get("symmetric", True) or acts.get("strategy", "token") != "token":
            raise _refuse(name, f"{'asymmetric ' if not acts.get('symmetric', True) else ''}activations with "
                                f"strategy {acts.get('strategy')!r} (dynamic symmetric per-token is served)")
    if group.get("output_activations"):
        raise _refuse(name, "output activation quantization")
    fmt = group.get("format") or default_format
    if fmt not in INT_FORMATS:
        raise _refuse(name, f"format {fmt!r} (served: {', '.join(INT_FORMATS)})")
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise _refuse(name, "a group without targets")
    return Scheme(targets, strategy, group_size if strategy == "group" else None, bool(acts), fmt)


def _check_kv_cache_scheme(scheme: dict[str, Any]) -> None:
    """An fp8 KV cache scheme: static per-tensor scales, which the checkpoint stores as each attention
    layer's ``k_scale`` / ``v_scale`` and core's loader reads (``pagoda.model_loader.kv_scales``).
    They are used when the engine runs an fp8 ``kv_cache_dtype`` (vLLM: the scheme does not choose it)."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"compressed-tensors kv_cache_scheme with {what} is not supported by "
                          "pagoda-quant-compressed-tensors (it reads fp8 static per-tensor k/v scales)")
    if scheme.get("type", "float") != "float" or int(scheme.get("num_bits", 8)) != 8:
        raise refuse(f"{scheme.get('num_bits')}-bit {scheme.get('type')} values")
    if scheme.get("strategy", "tensor") != "tensor":
        raise refuse(f"strategy {scheme.get('strategy')!r} (per-tensor is served)")
    if scheme.get("dynamic", False):
        raise refuse("dynamic scales")
    if not scheme.get("symmetric", True):
        raise refuse("asymmetric scales")


def _matches(pattern: str, prefix: str, layer_type: str) -> bool:
    """compressed-tensors' target / ignore matching: ``re:`` regex on the name, else a class name or the name itself."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return pattern == layer_type or pattern == prefix or prefix.endswith("." + pattern)


class CompressedTensorsConfig(QuantizationConfig):
    """vLLM's ``CompressedTensorsConfig`` for the int8 schemes above."""

    supports_tensor_parallel = True  # every tensor is sliced per rank (``_collector``)

    def __init__(self, schemes: list[Scheme], ignore: list[str]) -> None:
        super().__init__()
        self.schemes = schemes
        self.ignore = ignore
        self._used: set[str] = set()

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        status = config.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(f"compressed-tensors checkpoint with quantization_status {status!r}: only compressed "
                             "(or frozen) checkpoints hold quantized weights")
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported by pagoda-quant-compressed-tensors")
        kv_cache_scheme = config.get("kv_cache_scheme")
        if kv_cache_scheme:
            _check_kv_cache_scheme(kv_cache_scheme)
        groups = config.get("config_groups") or {}
        if not groups and not kv_cache_scheme:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        default_format = config.get("format")
        schemes = [_parse_group(name, group, default_format) for name, group in groups.items()]
        return cls(schemes, list(config.get("ignore") or []))

    def is_layer_skipped(self, prefix: str) -> bool:
        names = self.checkpoint_layer_names(prefix)
        skipped = [any(_matches(p, name, "Linear") for p in self.ignore) for name in names]
        if any(skipped) and not all(skipped):
            raise ValueError(f"compressed-tensors ignores some of {names} but not all: the fused layer {prefix} "
                             "cannot be half quantized")
        return all(skipped)

    def scheme_for(self, prefix: str) -> Scheme | None:
        names = self.checkpoint_layer_names(prefix)
        found = [next((s for s in self.schemes if any(_matches(t, n, "Linear") for t in s.targets)), None)
                 for n in names]
        if any(s != found[0] for s in found):
            raise ValueError(f"compressed-tensors gives the layers fused into {prefix} ({names}) different schemes")
        return found[0]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagoda.layers import Linear

        if not isinstance(layer, Linear) or self.is_layer_skipped(prefix):
            return None
        scheme = self.scheme_for(prefix)
        if scheme is None:
            return None
        self._used.add(scheme.name)
        return CompressedTensorsLinearMethod(scheme)

    def describe(self) -> str:
        used = ", ".join(sorted(self._used)) or "no layer"
        return f"quantization: compressed-tensors ({used}; {kernels.describe()})"


def _collector(layer: nn.Module, name: str, scheme: Scheme) -> Any:
    """The ``weight_loader`` of ``layer``'s tensor ``name``: keeps this tensor-parallel rank's slice of
    each checkpoint tensor under its shard (fused layers get one per checkpoint layer).

    Column-parallel layers take their output rows of the weight and of per-channel / per-group scales;
    row-parallel ones their input columns of the weight (``weight_packed``: four to an int32) and of
    per-group scales (whole groups). A per-tensor scale, and per-channel scales of a row-parallel
    layer, hold for every rank's slice and stay whole.
    """
    what = f"compressed-tensors {name}"

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        if name == "weight_shape":  # [rows, cols] of the checkpoint tensor; the rank's shape is set after loading
            part = loaded
        elif name == "weight_scale":
            part = loaded
            if scheme.strategy != "tensor":
                part = shard_output(layer, part, shard_id, dim=0, what=what)
            if scheme.strategy == "group":
                assert scheme.group_size is not None
                part = shard_input(layer, part, dim=1, unit=scheme.group_size, what=what)
        else:
            part = shard_output(layer, loaded, shard_id, dim=0, what=what)
            part = shard_input(layer, part, dim=1, unit=4 if name == "weight_packed" else 1, what=what)
        param.shards[0 if shard_id is None else shard_id] = part  # type: ignore[attr-defined]

    return load


def _unpack_int8(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """pack-quantized 8-bit: four values to an int32, little end first, each stored as value + 128."""
    rows, cols = (int(v) for v in shape.tolist())
    data = packed.contiguous()
    if sys.byteorder != "little":
        data = data.view(torch.uint8).view(-1, 4).flip(-1).contiguous()
    values = (data.view(torch.uint8).reshape(rows, -1)[:, :cols].to(torch.int16) - 128).to(torch.int8)
    return values.contiguous()


class CompressedTensorsLinearMethod(LinearMethodBase):
    """An int8 ``Linear``: the checkpoint's weight and scales, run by ``kernels`` (W8A8 or W8A16)."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.kernel: kernels.W8A8Weight | kernels.W8A16Weight | None = None

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],  # type: ignore[override]
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        self.in_features = input_size_per_partition
        self.out_features = sum(output_partition_sizes)
        self.input_size = input_size
        # the float weight was made on the model's device (and never filled): the int8 weight goes there,
        # so a CUDA / ROCm model's layers hold it on the GPU (the loader reads it into host memory)
        weight = getattr(layer, "weight", None)
        self.device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        names = ["weight_packed", "weight_shape"] if self.scheme.format == "pack-quantized" else ["weight"]
        if self.scheme.format != "pack-quantized":
            layer.register_parameter("weight", None)
        if self.scheme.format == "pack-quantized":
            check_input_split(layer, 4, "compressed-tensors weight_packed (four int8 values to an int32)")
        if self.scheme.group_size:
            check_input_split(layer, self.scheme.group_size, f"compressed-tensors groups of {self.scheme.group_size}")
        for name in [*names, "weight_scale"]:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = _collector(layer, name, self.scheme)  # type: ignore[attr-defined]
            param.shards = {}  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        if self.scheme.format == "pack-quantized":
            layer.register_parameter("weight", None)

    def _assembled(self, layer: nn.Module, name: str) -> list[torch.Tensor]:
        shards: dict[int, torch.Tensor] = getattr(layer, name).shards
        return [shards[i].to(self.device) for i in sorted(shards)]

    def _rank_shape(self, layer: nn.Module, packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        """The checkpoint's ``weight_shape`` for the slice of ``weight_packed`` this rank holds."""
        if not (output_split(layer) or input_split(layer)):
            return shape
        rows, cols = (int(v) for v in shape.tolist())
        if cols != self.input_size:
            raise ValueError(f"compressed-tensors weight_shape {(rows, cols)} for a layer of {self.input_size} inputs")
        return torch.tensor([packed.shape[0], self.in_features])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.format == "pack-quantized":
            parts = [_unpack_int8(p, self._rank_shape(layer, p, s)) for p, s in zip(
                self._assembled(layer, "weight_packed"), self._assembled(layer, "weight_shape"), strict=True)]
        else:
            parts = self._assembled(layer, "weight")
        if any(p.dtype != torch.int8 for p in parts):
            raise ValueError(f"compressed-tensors int8 weight stored as {parts[0].dtype}, not int8")
        weight = torch.cat(parts) if len(parts) > 1 else parts[0]
        scales = [s.float().reshape(max(s.shape[0], 1) if s.dim() else 1, -1) for s in self._assembled(layer, "weight_scale")]
        if self.scheme.strategy == "tensor":  # one scale a checkpoint tensor: per channel from here on
            scales = [s.reshape(1, 1).expand(p.shape[0], 1) for p, s in zip(parts, scales, strict=True)]
        scale = torch.cat(scales) if len(scales) > 1 else scales[0]
        rows, cols = weight.shape
        if (rows, cols) != (self.out_features, self.in_features):
            raise ValueError(f"compressed-tensors weight {tuple(weight.shape)} for a layer of "
                             f"{self.out_features} x {self.in_features}")
        groups = -(-cols // self.scheme.group_size) if self.scheme.group_size else 1
        if tuple(scale.shape) != (rows, groups):
            raise ValueError(f"compressed-tensors weight_scale {tuple(scale.shape)}, expected {(rows, groups)}")
        on_cpu = weight.device.type == "cpu"
        if self.scheme.dynamic_activations:
            if groups != 1:
                raise ValueError("W8A8 with grouped weight scales is not served (per channel or per tensor is)")
            self.kernel = kernels.W8A8Weight.prepare(weight, scale.reshape(-1), on_cpu)
        else:
            self.kernel = kernels.W8A16Weight.prepare(weight, scale, self.scheme.group_size or cols, on_cpu)
        # what the kernel keeps is the layer's memory now
        for name in ("weight", "weight_packed", "weight_shape", "weight_scale"):
            if getattr(layer, name, None) is not None:
                delattr(layer, name)
                layer.register_parameter(name, None)
        held = self.kernel.packed if self.kernel.packed is not None else self.kernel.weight
        layer.register_parameter("qweight", nn.Parameter(held, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        assert self.kernel is not None, "process_weights_after_loading has not run"
        lead = x.shape[:-1]
        y = self.kernel.matmul(x.reshape(-1, self.in_features), bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)
