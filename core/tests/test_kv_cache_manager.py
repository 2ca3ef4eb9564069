"""KVCacheManager: prefix hits, allocation, eviction, fork, copy-on-write, counters, no leaks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from pagoda.kv_cache.block_pool import NULL_BLOCK_ID
from pagoda.kv_cache.hashing import BlockHash, hash_request_blocks
from pagoda.kv_cache.manager import KVCacheManager

BLOCK_SIZE = 4


@dataclass
class Req:
    """The slice of the scheduler's Request the manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_size: int = BLOCK_SIZE
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)
        self._rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, *token_ids: int) -> None:
        self.all_token_ids.extend(token_ids)
        self._rehash()

    def _rehash(self) -> None:
        extra = (self.cache_salt,) if self.cache_salt else None
        hash_request_blocks(self.block_hashes, self.all_token_ids, self.block_size, extra)


def check_invariants(manager: KVCacheManager) -> None:
    """Ref counts equal owners, free queue == zero-ref blocks, cache index consistent."""
    pool = manager.block_pool
    owners = Counter(block.block_id for blocks in manager.req_to_blocks.values() for block in blocks)
    assert NULL_BLOCK_ID not in owners
    free_ids = [block.block_id for block in pool.free_block_queue.blocks()]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block in pool.free_block_queue), block
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash] is block
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def prefill(manager: KVCacheManager, req: Req, use_cache: bool = True) -> list[int]:
    """Look up the prefix, allocate the rest of the prompt and mark it computed."""
    hit_ids, hit_tokens = manager.get_computed_blocks(req) if use_cache else ([], 0)
    new_ids = manager.allocate_slots(req, req.num_tokens - hit_tokens, hit_ids, hit_tokens)
    assert new_ids is not None
    req.num_computed_tokens = req.num_tokens
    return hit_ids


def decode(manager: KVCacheManager, req: Req, token: int) -> list[int] | None:
    """One decode step: the sampled token is appended, then its slot is allocated."""
    req.append(token)
    new_ids = manager.allocate_slots(req, 1)
    if new_ids is not None:
        req.num_computed_tokens += 1
    return new_ids


# ---- prefix hits --------------------------------------------------------------


def test_prefix_hit_returns_the_first_requests_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = Req("a", range(10))  # 2 full blocks + 2 tokens
    prefill(manager, a)
    a_blocks = manager.get_block_ids("a")
    assert len(a_blocks) == 3
    b = Req("b", list(range(10)) + [99])
    hit_ids, hit_tokens = manager.get_computed_blocks(b)
    assert hit_ids == a_blocks[:2] and hit_tokens == 8
    new_ids = manager.allocate_slots(b, b.num_tokens - hit_tokens, hit_ids, hit_tokens)
    assert new_ids is not None and len(new_ids) == 1
    assert manager.get_block_ids("b") == a_blocks[:2] + new_ids
    assert [manager.block_pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    check_invariants(manager)


def test_prefix_hit_stops_one_token_short_of_a_block_aligned_prompt() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefill(manager, Req("a", range(8)))  # exactly 2 full blocks, both cached
    assert manager.block_pool.num_cached_blocks == 2
    hit_ids, hit_tokens = manager.get_computed_blocks(Req("b", range(8)))
    # The last block is dropped so its last token can be recomputed for logits.
    assert hit_ids == manager.get_block_ids("a")[:1] and hit_tokens == 4
    hit_ids, hit_tokens = manager.get_computed_blocks(Req("c", range(9)))
    assert hit_ids == manager.get_block_ids("a") and hit_tokens == 8
    # A single-block prompt can never be fully cached.
    assert manager.get_computed_blocks(Req("d", range(4))) == ([], 0)


def test_prefix_lookup_stops_at_first_miss() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefill(manager, Req("a", range(13)))
    tokens = list(range(13))
    tokens[5] = 1000  # second block differs, third is equal but has a different parent
    hit_ids, hit_tokens = manager.get_computed_blocks(Req("b", tokens))
    assert hit_ids == manager.get_block_ids("a")[:1] and hit_tokens == 4


def test_cache_salt_isolates_requests() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefill(manager, Req("a", range(9), cache_salt="tenant-1"))
    assert manager.get_computed_blocks(Req("b", range(9), cache_salt="tenant-2")) == ([], 0)
    assert manager.get_computed_blocks(Req("c", range(9)))[1] == 0
    assert manager.get_computed_blocks(Req("d", range(9), cache_salt="tenant-1"))[1] == 8


def test_hit_on_freed_blocks_takes_them_back_from_the_free_queue() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = Req("a", range(10))
    prefill(manager, a)
    a_blocks = manager.get_block_ids("a")
    manager.free(a)
    assert manager.num_free_blocks == 7
    b = Req("b", range(10))
    assert prefill(manager, b) == a_blocks[:2]
    assert manager.num_free_blocks == 7 - 3
    check_invariants(manager)


def test_decode_blocks_become_cached_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = Req("a", range(6))
    prefill(manager, a)
    assert manager.block_pool.num_cached_blocks == 1
    decode(manager, a, 100)  # 7 tokens
    assert manager.block_pool.num_cached_blocks == 1
    decode(manager, a, 101)  # 8 tokens: block 2 full and known
    assert manager.block_pool.num_cached_blocks == 2
    # A later request whose prompt is a's prompt + outputs hits both blocks.
    b = Req("b", list(range(6)) + [100, 101, 7])
    assert manager.get_computed_blocks(b) == (manager.get_block_ids("a"), 8)
    check_invariants(manager)


def test_blocks_whose_keys_lag_are_cached_on_a_later_call() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = Req("a", range(6))
    prefill(manager, a)
    a.all_token_ids += [6, 7]  # tokens appended, keys not yet extended
    assert manager.allocate_slots(a, 2) is not None
    a.num_computed_tokens = 8
    assert manager.block_pool.num_cached_blocks == 1
    a.append(8)  # now the keys catch up (block 2's key included)
    assert manager.allocate_slots(a, 1) is not None
    assert manager.block_pool.num_cached_blocks == 2
    assert manager.get_computed_blocks(Req("b", range(9)))[0] == manager.get_block_ids("a")[:2]


def test_chunked_prefill_caches_each_full_chunk() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = Req("a", range(14))
    assert manager.allocate_slots(a, 6) is not None  # 1 full block + 2 tokens
    a.num_computed_tokens = 6
    assert manager.block_pool.num_cached_blocks == 1
    assert manager.allocate_slots(a, 6) is not None  # up to 12 tokens: 3 full blocks
    a.num_computed_tokens = 12
    assert manager.block_pool.num_cached_blocks == 3
    assert len(manager.get_block_ids("a")) == 3
    check_invariants(manager)


def test_caching_disabled_never_hits() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    prefill(manager, Req("a", range(9)))
    assert manager.get_computed_blocks(Req("b", range(9))) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.make_prefix_cache_stats().queries == 0


# ---- eviction and running out --------------------------------------------------


def test_eviction_under_pressure_is_lru_and_tail_first() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    a = Req("a", range(8))  # two full blocks
    c = Req("c", range(100, 108))
    prefill(manager, a)
    prefill(manager, c)
    a_blocks, c_blocks = manager.get_block_ids("a"), manager.get_block_ids("c")
    manager.free(a)  # first freed: evicted first, its deepest block before its first
    manager.free(c)
    assert manager.block_pool.num_cached_blocks == 4
    d = Req("d", range(200, 203))
    assert manager.allocate_slots(d, 3) == [a_blocks[1]]
    # a keeps its first block cached; c keeps both.
    assert manager.get_computed_blocks(Req("a2", range(9)))[0] == a_blocks[:1]
    assert manager.get_computed_blocks(Req("c2", range(100, 109)))[0] == c_blocks
    e = Req("e", range(300, 306))
    assert manager.allocate_slots(e, 6) == [a_blocks[0], c_blocks[1]]
    check_invariants(manager)


def test_allocate_slots_out_of_blocks_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    a = Req("a", range(10))  # 3 blocks, two of them cached
    prefill(manager, a)
    manager.free(a)
    # b hits a's two free cached blocks and needs 3 more: 2 (taken from the free
    # queue by the hit) + 3 > 4 free, even though the 3 new ones alone would fit.
    b = Req("b", list(range(10)) + list(range(50, 60)))
    hit_ids, hit_tokens = manager.get_computed_blocks(b)
    assert hit_tokens == 8
    before = (
        manager.num_free_blocks,
        [block.block_id for block in manager.block_pool.free_block_queue.blocks()],
        [(block.ref_cnt, block.block_hash) for block in manager.block_pool.blocks],
        dict(manager.block_pool.cached_block_hash_to_block),
    )
    assert manager.allocate_slots(b, b.num_tokens - hit_tokens, hit_ids, hit_tokens) is None
    after = (
        manager.num_free_blocks,
        [block.block_id for block in manager.block_pool.free_block_queue.blocks()],
        [(block.ref_cnt, block.block_hash) for block in manager.block_pool.blocks],
        dict(manager.block_pool.cached_block_hash_to_block),
    )
    assert after == before
    assert manager.get_block_ids("b") == [] and "b" not in manager.req_to_blocks
    # A running request that cannot grow keeps what it had.
    c = Req("c", range(400, 416))
    assert manager.allocate_slots(c, 16) is not None
    c.num_computed_tokens = 16
    c.append(1)
    assert manager.allocate_slots(c, 1) is None
    assert len(manager.get_block_ids("c")) == 4
    check_invariants(manager)


def test_computed_blocks_evicted_in_between_is_an_error() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = Req("a", range(5))
    prefill(manager, a)
    manager.free(a)
    b = Req("b", range(5))
    hit_ids, hit_tokens = manager.get_computed_blocks(b)
    assert hit_tokens == 4
    manager.allocate_slots(Req("x", range(12)), 12)  # evicts everything
    with pytest.raises(ValueError, match="no longer holds"):
        manager.allocate_slots(b, 1, hit_ids, hit_tokens)


def test_bad_allocation_arguments_are_clear_errors() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = Req("a", range(9))
    prefill(manager, a)
    with pytest.raises(ValueError, match="do not match"):
        manager.allocate_slots(Req("b", range(9)), 1, manager.get_block_ids("a")[:2], 4)
    with pytest.raises(ValueError, match="already owns blocks"):
        manager.allocate_slots(a, 1, manager.get_block_ids("a")[:1], 4)
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=8, block_size=0)


# ---- accounting ---------------------------------------------------------------


def test_no_leaks_after_finish_and_abort() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    finished = Req("finished", range(11))
    prefill(manager, finished)
    for token in range(6):
        decode(manager, finished, token)
    aborted_mid_prefill = Req("aborted", range(30))
    assert manager.allocate_slots(aborted_mid_prefill, 8) is not None
    sharer = Req("sharer", range(11))
    prefill(manager, sharer)
    check_invariants(manager)
    manager.free(finished)
    manager.free(aborted_mid_prefill)
    manager.free(sharer)
    manager.free(sharer)  # a second free (abort after finish) is a no-op
    check_invariants(manager)
    assert manager.num_free_blocks == manager.num_usable_blocks == 31
    assert manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.req_to_blocks == {} and manager.num_cached_blocks == {}
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache_refused_while_running() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = Req("a", range(9))
    prefill(manager, a)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(Req("b", range(9)))[1] == 8
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(Req("b", range(9)))[1] == 0


def test_prefix_cache_counters_and_reset_on_read() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefill(manager, Req("a", range(10)))  # miss: 10 queried, 0 hit
    prefill(manager, Req("b", range(10)))  # 8 of 10 hit
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    fresh = manager.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits, fresh.hit_rate) == (0, 0, 0, 0.0)


# ---- fork and copy-on-write ---------------------------------------------------


def test_fork_shares_all_blocks_and_ref_counts() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = Req("p", range(6))
    prefill(manager, parent)
    free_before = manager.num_free_blocks
    assert manager.fork("p", "c") == manager.get_block_ids("p")
    assert manager.num_free_blocks == free_before
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in manager.get_block_ids("p"))
    check_invariants(manager)
    manager.free(parent)
    assert manager.num_free_blocks == free_before  # the child still holds them
    assert all(manager.block_pool.blocks[i].ref_cnt == 1 for i in manager.get_block_ids("c"))
    manager.free_request_id("c")
    assert manager.num_free_blocks == manager.num_usable_blocks
    check_invariants(manager)
    with pytest.raises(KeyError, match="owns no KV cache blocks"):
        manager.fork("p", "d")


def test_fork_into_existing_request_is_an_error() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, Req("p", range(3)))
    prefill(manager, Req("q", range(3)))
    with pytest.raises(ValueError, match="already owns"):
        manager.fork("p", "q")


def test_copy_on_write_in_allocate_slots() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = Req("p", range(6))  # block 0 full, block 1 holds 2 tokens
    prefill(manager, parent)
    manager.fork("p", "c")
    child = Req("c", range(6), num_computed_tokens=6)
    shared_full, shared_partial = manager.get_block_ids("p")

    assert decode(manager, child, 7) == []  # no new block needed, but a private copy
    copies, replaced = manager.take_copy_on_write()
    child_blocks = manager.get_block_ids("c")
    assert child_blocks[0] == shared_full and child_blocks[1] != shared_partial
    assert copies == [(shared_partial, child_blocks[1])] and replaced == {"c"}
    assert manager.get_block_ids("p") == [shared_full, shared_partial]
    assert manager.block_pool.blocks[shared_partial].ref_cnt == 1
    assert manager.block_pool.blocks[shared_full].ref_cnt == 2
    assert manager.take_copy_on_write() == ([], set())

    # The parent now owns its partial block alone: it writes in place.
    assert decode(manager, parent, 8) == []
    assert manager.take_copy_on_write() == ([], set())
    check_invariants(manager)

    # Both fill block 1 with different tokens: each is cached under its own sequence.
    decode(manager, parent, 9)
    decode(manager, child, 9)
    assert manager.get_computed_blocks(Req("x", list(range(6)) + [8, 9, 0]))[0] == [shared_full, shared_partial]
    assert manager.get_computed_blocks(Req("y", list(range(6)) + [7, 9, 0]))[0] == child_blocks
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == manager.num_usable_blocks
    check_invariants(manager)


def test_fork_at_block_boundary_needs_no_copy() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = Req("p", range(8))
    prefill(manager, parent)
    manager.fork("p", "c")
    child = Req("c", range(8), num_computed_tokens=8)
    new_ids = decode(manager, child, 1)
    assert new_ids is not None and len(new_ids) == 1
    assert manager.take_copy_on_write() == ([], set())


def test_shared_empty_lookahead_block_is_replaced_without_copy() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = Req("p", range(8))
    assert manager.allocate_slots(parent, 8, num_lookahead_tokens=2) is not None
    parent.num_computed_tokens = 8
    assert len(manager.get_block_ids("p")) == 3  # the third is an empty reserved block
    manager.fork("p", "c")
    child = Req("c", range(8), num_computed_tokens=8)
    shared_empty = manager.get_block_ids("p")[2]
    assert decode(manager, child, 1) == []
    copies, replaced = manager.take_copy_on_write()
    # The child got its own block for slot 8 but nothing needed copying into it.
    assert copies == [] and replaced == {"c"}
    assert manager.get_block_ids("c")[2] != shared_empty
    assert manager.block_pool.blocks[shared_empty].ref_cnt == 1
    check_invariants(manager)


def test_copy_on_write_method_and_out_of_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)  # 3 usable
    parent = Req("p", range(6))
    prefill(manager, parent)
    manager.fork("p", "c")
    child = Req("c", range(6), num_computed_tokens=6)
    shared_partial = manager.get_block_ids("p")[1]
    copies = manager.copy_on_write(child, 1)
    assert copies == [(shared_partial, manager.get_block_ids("c")[1])]
    assert manager.copy_on_write(child, 1) == []  # already private
    assert manager.take_copy_on_write() == ([], set())  # the direct call queues nothing
    # The last free block went to the copy: a second fork cannot copy.
    manager.fork("p", "d")
    grandchild = Req("d", range(6), num_computed_tokens=6)
    assert manager.num_free_blocks == 0
    before = manager.get_block_ids("d")
    assert manager.copy_on_write(grandchild, 1) is None
    assert manager.allocate_slots(grandchild, 1) is None
    assert manager.get_block_ids("d") == before
    check_invariants(manager)


# ---- randomized: a scheduler's life in miniature -------------------------------


class ShadowKV:
    """Token ids standing in for K/V: what each slot of each block would hold."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.slots: dict[int, list[int | None]] = {}

    def _block(self, block_id: int) -> list[int | None]:
        return self.slots.setdefault(block_id, [None] * BLOCK_SIZE)

    def run_step(self, req: Req, num_new_tokens: int) -> None:
        """Do the runner's part after a successful allocation: copies first, then writes."""
        copies, _ = self.manager.take_copy_on_write()
        for src, dst in copies:
            self.slots[dst] = list(self._block(src))
        table = self.manager.get_block_ids(req.request_id)
        for t in range(req.num_computed_tokens, req.num_computed_tokens + num_new_tokens):
            self._block(table[t // BLOCK_SIZE])[t % BLOCK_SIZE] = req.all_token_ids[t]
        req.num_computed_tokens += num_new_tokens

    def tokens_of(self, block_ids: list[int], num_tokens: int) -> list[int | None]:
        flat = [token for block_id in block_ids for token in self._block(block_id)]
        return flat[:num_tokens]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workload_keeps_invariants_and_kv_contents(seed: int) -> None:
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE)
    kv = ShadowKV(manager)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    running: dict[str, Req] = {}
    next_id = 0
    num_hit_tokens = num_forks = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.3:
            prompt = list(rng.choice(prompts)) + [rng.randrange(3) for _ in range(rng.randrange(3))]
            req = Req(str(next_id), prompt)
            next_id += 1
            hit_ids, hit_tokens = manager.get_computed_blocks(req)
            assert hit_tokens < req.num_tokens
            # A hit must hold exactly the prompt's tokens.
            assert kv.tokens_of(hit_ids, hit_tokens) == req.all_token_ids[:hit_tokens]
            num_hit_tokens += hit_tokens
            chunk = rng.randrange(1, req.num_tokens - hit_tokens + 1)
            if manager.allocate_slots(req, chunk, hit_ids, hit_tokens) is None:
                assert req.request_id not in manager.req_to_blocks
                continue
            req.num_computed_tokens = hit_tokens
            kv.run_step(req, chunk)
            running[req.request_id] = req
        elif action < 0.75 and running:
            req = running[rng.choice(sorted(running))]
            if req.num_computed_tokens < req.num_tokens:  # continue the prefill
                chunk = rng.randrange(1, req.num_tokens - req.num_computed_tokens + 1)
                if manager.allocate_slots(req, chunk) is not None:
                    kv.run_step(req, chunk)
            else:
                req.append(rng.randrange(3))
                if manager.allocate_slots(req, 1) is not None:
                    kv.run_step(req, 1)
                else:  # preempt: free everything; it would restart from scratch
                    manager.free(req)
                    del running[req.request_id]
        elif action < 0.87 and running:
            parent = running[rng.choice(sorted(running))]
            if parent.num_computed_tokens == parent.num_tokens:
                child = Req(str(next_id), parent.all_token_ids, num_computed_tokens=parent.num_computed_tokens)
                next_id += 1
                manager.fork(parent.request_id, child.request_id)
                running[child.request_id] = child
                num_forks += 1
        elif running:
            manager.free(running.pop(rng.choice(sorted(running))))
        check_invariants(manager)
        # Every running request reads back exactly its own computed tokens.
        for req in running.values():
            table = manager.get_block_ids(req.request_id)
            assert kv.tokens_of(table, req.num_computed_tokens) == req.all_token_ids[: req.num_computed_tokens]
    assert num_hit_tokens > 0 and num_forks > 0  # the workload exercised both paths
    for req in list(running.values()):
        manager.free(req)
    check_invariants(manager)
    assert manager.num_free_blocks == manager.num_usable_blocks
