"""Layers that model-family plugins share, whose compute a platform may specialise."""

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.linear import Linear, LinearKernel, prepare_linear_layers
from pagoda.layers.norm import RMSNorm
from pagoda.layers.ops import TORCH_LAYER_OPS, LayerOps, LayerOpsModule, TorchLayerOps, bind_layer_ops

__all__ = [
    "TORCH_LAYER_OPS",
    "LayerOps",
    "LayerOpsModule",
    "Linear",
    "LinearKernel",
    "RMSNorm",
    "SiluAndMul",
    "TorchLayerOps",
    "bind_layer_ops",
    "prepare_linear_layers",
]
