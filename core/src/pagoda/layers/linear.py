"""A linear layer whose matmul the platform chooses after the weights are loaded.

Model code builds ``Linear`` layers with Hugging Face parameter names and loads
weights into them as plain tensors. Once loading is done the model runner asks
the platform for a ``LinearKernel`` (``Platform.linear_kernel``) and lets it
convert every layer's weight into the form its matmul reads fastest -- on CPU a
oneDNN blocked layout, measured 1.3-2.5x faster than ``F.linear`` at decode
batch sizes. This is the role vLLM gives ``UnquantizedLinearMethod``'s
``process_weights_after_loading``; quantization methods will take the same hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.activation import SiluAndMul

if TYPE_CHECKING:
    from pagoda.lora.layers import LoRASlots
    from pagoda.quantization.base_config import LinearMethodBase


@runtime_checkable
class LinearKernel(Protocol):
    """How one platform computes ``x @ W^T + b`` from a prepared weight."""

    name: str

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``prepare`` can take this weight (dtype, device, shape)."""
        ...

    def prepare(self, weight: torch.Tensor) -> Any:
        """The weight in the kernel's own form; called once, after loading."""
        ...

    def apply(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] in ``x``'s dtype."""
        ...


@runtime_checkable
class SiluAndMulLinearKernel(LinearKernel, Protocol):
    """A ``LinearKernel`` that can also fuse SiLU-and-mul into a gate/up projection's matmul (optional).

    ``apply_silu_and_mul`` returns ``silu(gate) * up`` of ``x @ [gate; up]^T + b``, [T, out / 2], rounded
    as the two separate ops round (the projection's result to ``x``'s dtype first), so results are
    bit for bit those of ``apply`` followed by the platform's ``silu_and_mul``.
    """

    def supports_silu_and_mul(self, weight: torch.Tensor) -> bool:
        ...

    def prepare_silu_and_mul(self, weight: torch.Tensor) -> Any:
        ...

    def apply_silu_and_mul(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        ...


class Linear(nn.Module):
    """``y = x W^T + b``; ``weight`` is [out, in] and ``bias`` [out], as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # torch.empty: load_weights overwrites every parameter, and a random init is seconds for nothing
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kernel: LinearKernel | None = None
        self.prepared: Any = None
        # Set by pagoda.quantization.quantize_model: the method then holds the weights and computes the layer.
        self.quant_method: LinearMethodBase | None = None
        # A gated activation applied to the output (``activation``); fused: the kernel computes it in its matmul.
        self.act: nn.Module | None = None
        self.fused_activation = False
        # Set by pagoda.lora.model_manager (enable_lora): the adapter slots added to the matmul's output.
        self.lora: LoRASlots | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_activation:
            fused: Any = self.kernel  # a SiluAndMulLinearKernel, checked by prepare
            return fused.apply_silu_and_mul(x, self.prepared, self.bias)
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, self.bias)
        elif self.kernel is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self.kernel.apply(x, self.prepared, self.bias)
        if self.lora is not None:
            y = self.lora(x, y)
        return y if self.act is None else self.act(y)

    def prepare(self, kernel: LinearKernel, *, keep_weight: bool) -> bool:
        """Hand the weight to ``kernel``; False (and nothing changes) if it cannot take it.

        Unless ``keep_weight`` (the tensor is shared, e.g. a tied embedding), the plain
        weight is released so the prepared copy does not double the model's memory.
        """
        if self.quant_method is not None or not kernel.supports(self.weight.data):
            return False
        # an adapter adds to the projection before the activation: no fused activation under LoRA
        if (self.lora is None and isinstance(self.act, SiluAndMul) and isinstance(kernel, SiluAndMulLinearKernel)
                and kernel.supports_silu_and_mul(self.weight.data)):
            self.prepared = kernel.prepare_silu_and_mul(self.weight.data)
            self.fused_activation = True
        else:
            self.prepared = kernel.prepare(self.weight.data)
        self.kernel = kernel
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device), requires_grad=False)
        return True

    def extra_repr(self) -> str:
        kernel = f", kernel={self.kernel.name}" if self.kernel is not None else ""
        fused = ", activation fused" if self.fused_activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{kernel}{fused}"


def prepare_linear_layers(model: nn.Module, kernel: LinearKernel) -> int:
    """Prepare every ``Linear`` in ``model`` for ``kernel``; returns how many took it.

    A weight tensor that some other module also holds (tied input/output
    embeddings) stays in place beside the prepared copy.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.kernel is None:
            shared = owners.get(id(module.weight), 0) > 1
            count += module.prepare(kernel, keep_weight=shared)
    return count
