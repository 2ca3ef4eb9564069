from pagoda.attention.interface import AttentionBackend, AttentionMetadata, AttentionSpec
from pagoda.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "AttentionSpec"]
