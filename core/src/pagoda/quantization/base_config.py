"""The quantization contract, as vLLM draws it: a ``QuantizationConfig`` picks a method per layer.

* ``QuantizationConfig``: one checkpoint's quantization (read from ``config.json``'s
  ``quantization_config``, or from a GGUF file's tensor types). It names itself (``get_name``,
  the vLLM name users pass as ``quantization=``), the activation dtypes its kernels take, and
  hands each layer its method (``get_quant_method(layer, prefix)``), or None for a layer it
  leaves unquantized (skipped layers, layers it has no method for).
* ``QuantizeMethodBase`` / ``LinearMethodBase``: how one layer holds and applies its weights.
  ``create_weights`` declares the parameters the checkpoint fills (registered on the layer,
  each with a ``weight_loader(param, loaded_weight, shard_id)`` when the plain copy into a
  slice will not do), ``process_weights_after_loading`` turns them into the kernel's form, and
  ``apply`` computes the layer.

A layer without a method (``quant_method is None``) is today's unquantized path: its float
weight goes to the platform's ``LinearKernel`` (on CPU the packed GEMM).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one quantized layer holds and applies its weights."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        """Register on ``layer`` the parameters the checkpoint fills (replacing its float ``weight``)."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's output from its quantized weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - most methods need nothing
        """Turn the loaded parameters into what ``apply`` reads (once, after every weight is loaded)."""


class LinearMethodBase(QuantizeMethodBase):
    """A method for ``pagoda.layers.Linear``: ``y = x W^T + b`` from quantized ``W``."""

    @abstractmethod
    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """``output_partition_sizes``: the rows of each checkpoint tensor stacked into this layer
        (one entry for an unfused layer)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """``x`` [..., in] -> [..., out] in ``x``'s dtype."""


class EmbeddingMethodBase(QuantizeMethodBase):
    """A method for ``pagoda.layers.Embedding`` (vocabulary rows), which may also serve as a tied LM head."""

    @abstractmethod
    def create_weights(  # type: ignore[override]
        self, layer: nn.Module, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None: ...

    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` of the table, dequantized (only those rows)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """``x @ table^T``: the logits of a tied LM head."""


class QuantizationConfig(ABC):
    """One checkpoint's quantization (vLLM's ``QuantizationConfig``)."""

    # Fused layer -> the checkpoint layers stacked into it (the model's ``packed_modules_mapping``,
    # set by pagoda.quantization.quantize_model), so a skip list of checkpoint names can name fused layers.
    packed_modules_mapping: dict[str, list[str]]

    # Whether the method's weights can be stored dequantized instead (quantization="none"):
    # true for GGUF files, whose loader can dequantize every block type.
    dequantizable: ClassVar[bool] = False

    # Whether the methods load each tensor-parallel rank's slice of their tensors (through
    # pagoda.layers.parallel_linear's shard_output / shard_input). A config that does not is refused
    # at tensor_parallel_size > 1, quoting ``tensor_parallel_unsupported_reason``.
    supports_tensor_parallel: ClassVar[bool] = False
    tensor_parallel_unsupported_reason: ClassVar[str] = "its methods do not split their weights across ranks"

    def __init__(self) -> None:
        self.packed_modules_mapping = {}
        # Set by resolve_quantization for a GGUF file's method found from its tensor types (not asked
        # for): a model family that cannot hold quantized layers then loads the file dequantized, as
        # GGUF files always loaded, instead of failing.
        self.dequantize_unsupported = False

    def checkpoint_layer_names(self, prefix: str) -> list[str]:
        """The checkpoint layers a (possibly fused) model layer holds: ``...qkv_proj`` -> ``...q_proj``,
        ``...k_proj``, ``...v_proj`` (through ``packed_modules_mapping``); an unfused layer is itself."""
        head, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last)
        if not parts:
            return [prefix]
        return [f"{head}.{p}" if head else p for p in parts]

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The vLLM name (``quantization=``, ``quantization_config.quant_method``)."""

    @classmethod
    @abstractmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        """Activation (model) dtypes the method's kernels take."""

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        """Files beside the weights that hold the config (besides ``config.json``)."""
        return []

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from ``quantization_config`` (HF ``config.json``), or ``{}`` for a GGUF file."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix`` in the model), or None to leave it unquantized."""

    def is_layer_skipped(self, prefix: str) -> bool:
        """Whether the checkpoint keeps ``prefix`` unquantized (its ``ignore`` / ``modules_to_not_convert``)."""
        return False

    def describe(self) -> str:
        """One line for the start-up log."""
        return f"quantization: {self.get_name()}"

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: Sequence[str]) -> Any:
        """The value of the first of ``keys`` present in ``config``; ValueError naming them all when none is."""
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"cannot find any of {list(keys)} in the model's quantization config")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: Sequence[str], default: Any) -> Any:
        try:
            return QuantizationConfig.get_from_keys(config, keys)
        except ValueError:
            return default
