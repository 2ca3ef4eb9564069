"""Block pool: free queue order and O(1) operations, ref counting, cache index, eviction."""

from __future__ import annotations

import time

import pytest

from pagoda.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock
from pagoda.kv_cache.hashing import hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def key(i: int) -> bytes:
    return hash_block_tokens(None, [i])


# ---- FreeBlockQueue ---------------------------------------------------------


def test_free_queue_fifo_and_remove_from_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and ids(queue.blocks()) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert ids(queue.blocks()) == [0, 1, 3, 4] and len(queue) == 4
    assert blocks[2] not in queue
    queue.append(blocks[2])
    assert ids(queue.blocks()) == [0, 1, 3, 4, 2]
    assert queue.popleft() is blocks[0]
    queue.appendleft(blocks[0])
    assert ids(queue.blocks()) == [0, 1, 3, 4, 2]
    assert ids(queue.popleft_n(3)) == [0, 1, 3]
    queue.remove(blocks[2])  # the tail
    queue.remove(blocks[4])  # the last one
    assert len(queue) == 0 and queue.blocks() == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_rejects_double_insert_and_missing_remove() -> None:
    block = KVCacheBlock(7)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)
    queue.remove(block)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    with pytest.raises(IndexError, match="only 0 free"):
        queue.popleft_n(1)


def test_free_queue_remove_is_constant_time() -> None:
    # Removing from the middle of a 200k-block queue must not scan it: 20k removals
    # from a huge queue take about as long as from a small one.
    def time_removals(size: int) -> float:
        blocks = [KVCacheBlock(i) for i in range(size)]
        queue = FreeBlockQueue(blocks)
        middle = blocks[size // 2 - 10_000 : size // 2 + 10_000]
        best = float("inf")
        for _ in range(3):  # best of 3: the machine is shared
            start = time.perf_counter()
            for block in middle:
                queue.remove(block)
            for block in middle:
                queue.append(block)
            best = min(best, time.perf_counter() - start)
        return best

    small, large = time_removals(20_000), time_removals(200_000)
    assert large < small * 5 + 0.05


# ---- BlockPool --------------------------------------------------------------


def test_null_block_is_reserved() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
    got = pool.get_new_blocks(3)
    assert NULL_BLOCK_ID not in ids(got)
    assert pool.usage == 1.0
    # touch/free ignore the null block rather than corrupting its count.
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.null_block not in pool.free_block_queue
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, enable_caching=True)


def test_get_new_blocks_and_free_accounting() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert all(block.ref_cnt == 1 for block in blocks)
    assert pool.num_free_blocks == 2 and pool.usage == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2  # the failed request took nothing
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(blocks[:1])


def test_cached_free_block_is_a_hit_until_reused() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [key(0), key(1)], 0, 2)
    pool.free_blocks([b, a])
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(key(0)) is a and a.block_hash == key(0)
    # A hit on a free block takes it out of the free queue.
    pool.touch([a])
    assert a.ref_cnt == 1 and a not in pool.free_block_queue and pool.num_free_blocks == 2
    pool.free_blocks([a])
    # Allocating everything reuses (evicts) the cached blocks.
    pool.get_new_blocks(3)
    assert pool.get_cached_block(key(0)) is None and pool.get_cached_block(key(1)) is None
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_cached_blocks == 0


def test_uncached_blocks_are_reused_before_cached_ones_and_cached_in_lru_order() -> None:
    pool = BlockPool(7, enable_caching=True)
    blocks = pool.get_new_blocks(6)
    b1, b2, b3, b4, b5, b6 = blocks
    pool.cache_full_blocks([b1, b2, b3], [key(1), key(2), key(3)], 0, 3)
    # Freed in this order: cached b3 (oldest), uncached b4, cached b1, cached b2, uncached b5.
    pool.free_blocks([b3, b4, b1, b2, b5])
    # Uncached go first (most recently freed uncached first), then cached in free order.
    assert ids(pool.free_block_queue.blocks()) == [5, 4, 3, 1, 2]
    first_two = pool.get_new_blocks(2)
    assert ids(first_two) == [5, 4]
    assert pool.num_cached_blocks == 3  # nothing evicted yet
    assert ids(pool.get_new_blocks(1)) == [3]  # the least recently freed cached block
    assert pool.get_cached_block(key(3)) is None and pool.get_cached_block(key(1)) is b1


def test_cache_full_blocks_skips_keyed_and_duplicate_blocks() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [key(0)], 0, 1)
    # Same key from a second request that filled an identical block at the same time.
    pool.cache_full_blocks([c], [key(0)], 0, 1)
    assert pool.get_cached_block(key(0)) is a and c.block_hash is None
    # A keyed block is never re-keyed.
    pool.cache_full_blocks([a, b], [key(9), key(1)], 0, 2)
    assert a.block_hash == key(0) and b.block_hash == key(1)
    with pytest.raises(ValueError, match="cannot cache"):
        pool.cache_full_blocks([a], [key(0), key(1)], 0, 2)
    # Evicting the duplicate-free block c must not drop a's entry.
    pool.free_blocks([c])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(key(0)) is a


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [key(0), key(1)], 0, 2)
    assert pool.num_cached_blocks == 0 and all(block.block_hash is None for block in blocks)


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [key(0), key(1)], 0, 2)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(key(0)) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 3
