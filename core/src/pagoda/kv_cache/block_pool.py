"""KV cache blocks, their free queue and the prefix-cache index.

All blocks exist from the start; a block is *in use* while its reference count
is positive and *free* (in the free queue) at zero. A free block keeps its
prefix-cache key until it is handed out again: free-but-keyed blocks are the
prefix cache, and handing one out is the eviction.

Free queue order (head is handed out first):
- blocks freed without a key (partial blocks, or caching off) go to the head:
  they hold nothing worth keeping, so they are reused before any cached block;
- blocks freed with a key go to the tail, so cached blocks are evicted least
  recently freed first (LRU). A request frees its blocks tail-first, so a
  prefix's deeper blocks are evicted before the shallow ones others share.

Block 0 is the *null block*: never handed out, never freed, never cached. Block
tables are padded with 0, and writes to padding slots therefore never clobber a
real block. ``num_blocks`` counts it, so ``num_blocks - 1`` blocks are usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagoda.kv_cache.hashing import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of KV cache: ``block_size`` token slots in every layer."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix-cache key while the block is indexed in the pool; None otherwise.
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, popleft and removal from the middle.

    The links live on the blocks themselves, so no node objects are allocated.
    Two sentinel blocks (id -1) bound the list and remove every edge case.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise IndexError("no free KV cache blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} free KV cache blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free_block, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        following = anchor.next_free_block
        assert following is not None
        block.prev_free_block = anchor
        block.next_free_block = following
        anchor.next_free_block = block
        following.prev_free_block = block
        self.num_free_blocks += 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first (O(n): for tests and debugging)."""
        out: list[KVCacheBlock] = []
        current = self._head.next_free_block
        while current is not None and current is not self._tail:
            out.append(current)
            current = current.next_free_block
        return out


class BlockPool:
    """Owns every block, the free queue and the map from prefix-cache key to block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # One block per key: when two requests fill identical blocks at the same
        # time, the first to finish its block is indexed, the other is not.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (free-but-cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` free blocks with ref_cnt 1, evicting their cache keys."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} KV cache blocks: only {self.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        # A block carries a key only while the index maps that key to it.
        del self.cached_block_hash_to_block[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference; a free block (a cache hit) leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the given order."""
        for block in blocks_in_eviction_order:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes`` of the same positions.

        Blocks already keyed (prefix hits, blocks shared by a fork) are left
        alone; a key already indexed to another block is not indexed twice.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(block_hashes) or num_full_blocks > len(blocks):
            raise ValueError(
                f"cannot cache {num_full_blocks} blocks: {len(blocks)} blocks and {len(block_hashes)} hashes given"
            )
        index = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = block_hashes[i]
            if block_hash in index:
                continue
            block.block_hash = block_hash
            index[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cache key; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
