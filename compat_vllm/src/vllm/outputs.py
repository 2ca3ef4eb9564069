"""``vllm.outputs``: pagoda's output records under vLLM's module path."""

from pagoda.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
    "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "RequestOutput", "ScoringOutput",
    "ScoringRequestOutput",
]
