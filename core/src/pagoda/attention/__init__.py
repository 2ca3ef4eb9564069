from pagoda.attention.interface import AttentionBackend, AttentionLayerParams, AttentionMetadata, AttentionSpec
from pagoda.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionLayerParams", "AttentionMetadata", "AttentionSpec"]
