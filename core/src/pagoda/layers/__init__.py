"""Layers that model-family plugins share, whose compute a platform may specialise."""

from pagoda.layers.activation import Activation, GeluAndMul, SiluAndMul, gated_activation
from pagoda.layers.alibi import get_alibi_slopes
from pagoda.layers.attention_block import HeadNormFactory, RotaryAttention
from pagoda.layers.embedding import Embedding
from pagoda.layers.head_norm import PerHeadLayerNorm
from pagoda.layers.linear import Linear, LinearKernel, SiluAndMulLinearKernel, prepare_linear_layers
from pagoda.layers.moe import FusedMoE, GatedMLP, fused_experts, fused_topk
from pagoda.layers.norm import LayerNorm, RMSNorm
from pagoda.layers.ops import TORCH_LAYER_OPS, LayerOps, LayerOpsModule, TorchLayerOps, bind_layer_ops
from pagoda.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    check_tensor_parallel_support,
)
from pagoda.layers.rope_scaling import RopeConfig, rope_config_from_hf
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "TORCH_LAYER_OPS",
    "Activation",
    "ColumnParallelLinear",
    "Embedding",
    "FusedMoE",
    "GatedMLP",
    "GeluAndMul",
    "HeadNormFactory",
    "LayerNorm",
    "LayerOps",
    "LayerOpsModule",
    "Linear",
    "LinearKernel",
    "SiluAndMulLinearKernel",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "PerHeadLayerNorm",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RopeConfig",
    "RotaryAttention",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "TorchLayerOps",
    "VocabParallelEmbedding",
    "bind_layer_ops",
    "check_tensor_parallel_support",
    "fused_experts",
    "fused_topk",
    "gated_activation",
    "get_alibi_slopes",
    "prepare_linear_layers",
    "rope_config_from_hf",
]
