"""Building a transformers model without paying for its weights twice.

Parameters are created on the meta device and later materialised with
``torch.empty`` (``load_weights`` overwrites every one), and transformers'
random initialisation is switched off, so building costs neither memory nor
init kernels. Buffers are built for real: they are computed at construction
(RoPE frequencies, causal-mask tables) and no checkpoint holds them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pagoda.layers import Linear


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block moves to the meta device; buffers stay where they are built.

    A parameter is first allocated where the module's constructor puts it (``torch.empty``-cheap with
    transformers' init switched off) and freed at once, so the peak is one parameter, never the model.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Give every meta parameter real (uninitialised) storage, keeping tied parameters one tensor.

    Returns how many distinct tensors were allocated.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = replaced.get(id(param))
            if new is None:
                data = torch.empty(param.shape, dtype=dtype if param.is_floating_point() else param.dtype, device=device)
                new = nn.Parameter(data, requires_grad=False)
                replaced[id(param)] = new
            module._parameters[name] = new
    return len(replaced)


class TransformersLinear(Linear):
    """pagoda's ``Linear`` in place of a transformers ``nn.Linear``: the platform's packed matmul serves it.

    transformers calls it on [batch, T, in]; the kernels take [rows, in].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return super().forward(x)
        flat = super().forward(x.reshape(-1, x.shape[-1]))
        return flat.view(*x.shape[:-1], self.out_features)


def replace_linear_layers(model: nn.Module) -> int:
    """Swap every module whose type is exactly ``nn.Linear`` for a ``TransformersLinear`` holding the same parameters.

    Subclasses of ``nn.Linear`` (quantized or otherwise specialised layers) keep their own forward. The
    parameters are the same objects, so tied weights stay tied. Returns how many layers were swapped.
    """
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            with torch.device("meta"):  # the new layer's own parameters are dropped at once
                layer = TransformersLinear(child.in_features, child.out_features, child.bias is not None, child.weight.dtype)
            layer.weight = child.weight  # type: ignore[assignment]  # nn.Linear's Parameter
            layer.bias = child.bias  # type: ignore[assignment]  # a Parameter or None, as nn.Linear holds it
            setattr(parent, child_name, layer)
            swapped += 1
    return swapped
