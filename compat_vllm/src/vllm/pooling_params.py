"""``vllm.pooling_params``."""

from pagoda.pooling_params import PoolingParams

__all__ = ["PoolingParams"]
