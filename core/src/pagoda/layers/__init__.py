"""Layers that model-family plugins share, whose compute a platform may specialise."""

from pagoda.layers.linear import Linear, LinearKernel, prepare_linear_layers

__all__ = ["Linear", "LinearKernel", "prepare_linear_layers"]
