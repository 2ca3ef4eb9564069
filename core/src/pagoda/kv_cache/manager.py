"""Which KV blocks each request owns: prefix-cache lookup, allocation, fork, copy-on-write, free.

The request object is duck-typed; the manager reads
``request_id: str``, ``num_tokens: int`` (prompt + outputs so far),
``num_computed_tokens: int``, ``all_token_ids`` and ``block_hashes``.

The scheduler (through the Request) must keep ``request.block_hashes`` up to
date: after tokens are appended, extend it with
``hash_request_blocks(request.block_hashes, request.all_token_ids, block_size, extra_keys)``.
The manager never hashes; it indexes a request's newly full blocks under the
keys it finds there (blocks without a key yet are indexed on a later call).

Call order per request in one scheduling step:
``get_computed_blocks`` (new requests only) -> ``allocate_slots`` with its
result, with no other allocation in between (the hit blocks may be free and
could otherwise be evicted; ``allocate_slots`` checks and raises if they were).
A block is indexed as soon as the step that fills it is scheduled, before its
K/V is written; a request hitting it in the same step is safe because every
attention layer writes the step's K/V before reading the cache.

Prompt-logprob requests need logits for every prompt token, so the scheduler
must not use ``get_computed_blocks`` for them (call ``allocate_slots`` alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.kv_cache.block_pool import BlockPool, KVCacheBlock


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset: tokens looked up and tokens found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were already offered to the prefix index.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Copy-on-write done inside allocate_slots, drained by take_copy_on_write.
        self.pending_block_copies: list[tuple[int, int]] = []
        self.requests_with_replaced_blocks: set[str] = set()
        # Prefix hits share only full blocks, which are never written again; only a fork
        # shares blocks that are still being written, so the copy-on-write scan of the
        # write range is skipped until the first fork.
        self._has_forked = False

    # ---- state -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counters since the last call, then reset them (for per-interval metrics)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key. Refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    # ---- prefix cache ------------------------------------------------------

    def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
        """The longest cached prefix of ``request``: (block ids, number of tokens they hold).

        Stops at least one token short of ``request.num_tokens``: the last
        token must be recomputed to produce logits. Touches nothing; pass the
        result to ``allocate_slots``.
        """
        if not self.enable_caching:
            return [], 0
        # Blocks lying wholly before the last token; a prompt of exactly k
        # full blocks therefore looks up only k - 1 of them.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = request.block_hashes
        get_cached_block = self.block_pool.get_cached_block
        hit_ids: list[int] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hit_ids.append(block.block_id)
        num_hit_tokens = len(hit_ids) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return hit_ids, num_hit_tokens

    # ---- allocation --------------------------------------------------------

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        new_computed_block_ids: list[int] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make ``request`` own blocks for all its computed tokens plus ``num_new_tokens``.

        ``new_computed_block_ids`` / ``num_new_computed_tokens`` are a prefix
        hit from ``get_computed_blocks`` (first allocation only); they become
        the request's first blocks. ``num_lookahead_tokens`` reserves extra
        slots (speculative tokens). Returns the ids of the blocks newly taken
        from the free queue, in order (possibly empty), or None when too few
        blocks are free, in which case nothing changed.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0: num_new_tokens={num_new_tokens}, num_lookahead_tokens={num_lookahead_tokens}"
            )
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        pool = self.block_pool
        block_size = self.block_size
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after_step = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-(num_tokens_after_step + num_lookahead_tokens) // block_size)

        computed_blocks: list[KVCacheBlock] = []
        num_free_hits = 0
        if new_computed_block_ids or num_new_computed_tokens:
            computed_blocks = self._resolve_computed_blocks(
                request, req_blocks, new_computed_block_ids or [], num_new_computed_tokens
            )
            # Touching a free hit block takes it out of the free queue too.
            num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        num_owned_blocks = (len(req_blocks) if req_blocks else 0) + len(computed_blocks)
        num_new_blocks = max(0, num_required_blocks - num_owned_blocks)
        # Shared (forked) blocks this step writes into get private copies first, so a
        # block is never indexed under one sharer's tokens while another writes it.
        shared: list[int] = []
        if self._has_forked and req_blocks:
            shared = self._shared_blocks_in_range(
                req_blocks, num_computed_tokens, num_new_tokens + num_lookahead_tokens
            )
        if num_new_blocks + num_free_hits + len(shared) > pool.num_free_blocks:
            return None

        if shared:
            assert req_blocks is not None
            self.pending_block_copies += self._replace_shared_blocks(req_blocks, shared, num_computed_tokens)
            self.requests_with_replaced_blocks.add(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = 0
        if computed_blocks:
            pool.touch(computed_blocks)
            req_blocks.extend(computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Blocks full after this step whose key is known (keys exist only for
            # full blocks of real tokens, never for lookahead slots).
            block_hashes = request.block_hashes
            num_full_blocks = min(num_tokens_after_step // block_size, len(block_hashes))
            num_cached = self.num_cached_blocks[request_id]
            if num_full_blocks > num_cached:
                pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full_blocks)
                self.num_cached_blocks[request_id] = num_full_blocks
        return [block.block_id for block in new_blocks]

    def _resolve_computed_blocks(
        self,
        request: Any,
        req_blocks: list[KVCacheBlock] | None,
        block_ids: list[int],
        num_tokens: int,
    ) -> list[KVCacheBlock]:
        if num_tokens != len(block_ids) * self.block_size:
            raise ValueError(
                f"request {request.request_id!r}: {num_tokens} new computed tokens do not match "
                f"{len(block_ids)} computed blocks of {self.block_size}"
            )
        if not block_ids:
            return []
        if req_blocks:
            raise ValueError(
                f"request {request.request_id!r} already owns blocks; prefix hits apply to its first allocation only"
            )
        blocks = [self.block_pool.blocks[block_id] for block_id in block_ids]
        hashes = request.block_hashes
        for i, block in enumerate(blocks):
            # The hit must still hold the prefix it was found for (no eviction in between).
            if block.block_hash is None or i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(
                    f"request {request.request_id!r}: computed block {block.block_id} no longer holds "
                    f"prefix block {i}; call allocate_slots right after get_computed_blocks"
                )
        return blocks

    def free(self, request: Any) -> None:
        """Release every block of ``request`` (finished, aborted or preempted); no-op if it owns none.

        Tail first, so its deepest cached blocks are evicted before its shallow
        ones, which other requests are likelier to share.
        """
        self.free_request_id(request.request_id)

    def free_request_id(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # ---- sharing: parallel sampling and beam search ------------------------

    def fork(self, parent_request_id: str, child_request_id: str) -> list[int]:
        """Make the child share every block of the parent; returns the child's block ids.

        The child must hold the same tokens (and ``num_computed_tokens``) as the
        parent at the moment of the fork. Whichever of them next writes into a
        shared partial block gets a private copy from ``allocate_slots``; the
        scheduler forwards the copies from ``take_copy_on_write`` to the runner.
        """
        parent_blocks = self.req_to_blocks.get(parent_request_id)
        if parent_blocks is None:
            raise KeyError(f"cannot fork {parent_request_id!r}: it owns no KV cache blocks")
        if child_request_id in self.req_to_blocks:
            raise ValueError(f"cannot fork into {child_request_id!r}: it already owns KV cache blocks")
        child_blocks = list(parent_blocks)
        self.block_pool.touch(child_blocks)
        self._has_forked = True
        self.req_to_blocks[child_request_id] = child_blocks
        self.num_cached_blocks[child_request_id] = self.num_cached_blocks[parent_request_id]
        return [block.block_id for block in child_blocks]

    def copy_on_write(self, request: Any, num_new_tokens: int = 1) -> list[tuple[int, int]] | None:
        """Give ``request`` private copies of the shared blocks its next ``num_new_tokens`` write into.

        A block shared after ``fork`` (ref_cnt > 1) that lies in the write
        range ``[request.num_computed_tokens, + num_new_tokens)`` is replaced
        in the request's block table by a fresh block. Returns ``(src, dst)``
        block-id pairs whose K/V the runner must copy before the step (only
        blocks holding tokens before the write position need a copy), or
        None, with nothing changed, when too few blocks are free.

        ``allocate_slots`` already does this for its write range (pairs
        collected by ``take_copy_on_write``); call this directly only to
        copy outside an allocation. Either way the replaced entries change the
        request's block table in place (not an append): the runner must get
        the request's full block ids again.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks or num_new_tokens <= 0:
            return []
        shared = self._shared_blocks_in_range(blocks, request.num_computed_tokens, num_new_tokens)
        if len(shared) > self.block_pool.num_free_blocks:
            return None
        return self._replace_shared_blocks(blocks, shared, request.num_computed_tokens)

    def take_copy_on_write(self) -> tuple[list[tuple[int, int]], set[str]]:
        """Copies made by ``allocate_slots`` since the last call: ((src, dst) pairs, ids of requests whose
        block tables had entries replaced). The scheduler sends both to the runner, then they are reset."""
        copies, self.pending_block_copies = self.pending_block_copies, []
        request_ids, self.requests_with_replaced_blocks = self.requests_with_replaced_blocks, set()
        return copies, request_ids

    def _shared_blocks_in_range(self, blocks: list[KVCacheBlock], first_write: int, num_tokens: int) -> list[int]:
        first_index = first_write // self.block_size
        end_index = min(_cdiv(first_write + num_tokens, self.block_size), len(blocks))
        return [i for i in range(first_index, end_index) if blocks[i].ref_cnt > 1]

    def _replace_shared_blocks(
        self, blocks: list[KVCacheBlock], shared: list[int], first_write: int
    ) -> list[tuple[int, int]]:
        if not shared:
            return []
        private = self.block_pool.get_new_blocks(len(shared))
        copies: list[tuple[int, int]] = []
        old_blocks: list[KVCacheBlock] = []
        for index, new_block in zip(shared, private, strict=True):
            old_block = blocks[index]
            if index * self.block_size < first_write:
                copies.append((old_block.block_id, new_block.block_id))
            old_blocks.append(old_block)
            blocks[index] = new_block
        # Each old block is still referenced by its other sharers, so none becomes free here.
        self.block_pool.free_blocks(old_blocks)
        return copies
