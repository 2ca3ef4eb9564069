"""Pooling models: pooler settings and runner choice (torch-free), poolers (``pagoda.pooling.pooler``)."""

from pagoda.pooling.config import (
    POOLING_TYPES,
    PoolerConfig,
    PoolingModelInfo,
    PoolingType,
    load_sentence_transformers_config,
)

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingModelInfo", "PoolingType", "load_sentence_transformers_config"]
