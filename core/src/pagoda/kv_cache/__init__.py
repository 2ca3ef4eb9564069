"""Paged KV cache bookkeeping: block pool, prefix-cache keys, per-request block tables.

Pure Python, no torch: the tensors themselves belong to the model runner.
"""

from pagoda.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock
from pagoda.kv_cache.hashing import BlockHash, hash_block_tokens, hash_request_blocks, request_extra_keys
from pagoda.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "hash_request_blocks",
    "request_extra_keys",
]
