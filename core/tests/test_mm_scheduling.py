"""Multimodal scheduling: the encoder budget, the encoder cache's references and evictions, and the prefix
cache's keys with each item's content hash mixed in (no model: scheduler requests with typed mm records)."""

from __future__ import annotations

import torch

from pagoda.kv_cache.manager import KVCacheManager
from pagoda.multimodal.inputs import MultiModalFeature, MultiModalInputs, PlaceholderRange
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.encoder_cache import EncoderCacheManager
from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.scheduler.request import Request, RequestStatus, prompt_block_hashes
from pagoda.scheduler.scheduler import Scheduler

BLOCK = 4
IMAGE = 99


def mm_request(rid: str, images: list[tuple[str, int, int]], n: int, max_tokens: int = 2) -> Request:
    """A prompt of ``n`` tokens with the image items (identifier, offset, length) as placeholder runs."""
    ids = [1 + i % 50 for i in range(n)]
    for _, offset, length in images:
        ids[offset:offset + length] = [IMAGE] * length
    mm = MultiModalInputs([MultiModalFeature("image", ident, PlaceholderRange(off, length), {"pixel_values": torch.zeros(1)})
                           for ident, off, length in images])
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), eos_token_id=0, block_size=BLOCK, mm=mm)


def make(budget: int = 32, encoder_budget: int | None = None, cache: int | None = None, blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(blocks, BLOCK, enable_caching=True)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                     max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=cache)


def step(s: Scheduler):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so


def test_item_encoded_once_across_chunks_and_chunk_ends_inside_it() -> None:
    s = make(budget=6)
    s.add_request(mm_request("a", [("img", 2, 8)], 12))
    so = step(s)
    # the chunk [0, 6) ends inside the image's placeholders [2, 10): encoded now, whole
    assert so.num_scheduled_tokens == {"a": 6} and so.scheduled_encoder_inputs == {"a": [0]}
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 6} and so.scheduled_encoder_inputs == {}  # read from the cache
    # computed past its placeholders: the request no longer holds it, the cache keeps it until space is needed
    assert s.encoder_cache.num_references("img") == 0 and "img" in s.encoder_cache


def test_encoder_budget_stops_chunk_before_the_next_item() -> None:
    s = make(budget=64, encoder_budget=8)
    s.add_request(mm_request("a", [("i1", 1, 8), ("i2", 12, 8)], 24))
    so = step(s)
    # i2 does not fit in what is left of the encoder budget: the chunk stops where its placeholders start
    assert so.num_scheduled_tokens == {"a": 12} and so.scheduled_encoder_inputs == {"a": [0]}
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 12} and so.scheduled_encoder_inputs == {"a": [1]}


def test_item_larger_than_the_budget_runs_alone() -> None:
    s = make(budget=64, encoder_budget=4)
    s.add_request(mm_request("a", [("big", 0, 10)], 12))
    s.add_request(mm_request("b", [("other", 0, 4)], 6))
    so = step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]} and "b" not in so.num_scheduled_tokens
    so = step(s)
    assert so.scheduled_encoder_inputs == {"b": [0]}


def test_same_image_in_two_requests_encoded_once() -> None:
    s = make(budget=64)
    s.add_request(mm_request("a", [("img", 0, 8)], 10))
    s.add_request(mm_request("b", [("img", 2, 8)], 12))
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"a": [0]} and so.num_scheduled_tokens == {"a": 10, "b": 12}


def test_abort_and_preemption_release_entries_and_eviction_tells_the_runner() -> None:
    s = make(budget=4, cache=12)
    s.add_request(mm_request("a", [("i1", 0, 12)], 14, max_tokens=50))
    step(s)  # [0, 4): inside the image, which stays referenced
    assert s.encoder_cache.num_references("i1") == 1
    s._preempt(s.requests["a"])
    assert s.requests["a"].status == RequestStatus.PREEMPTED
    assert s.encoder_cache.num_references("i1") == 0 and "i1" in s.encoder_cache  # kept until space is needed
    so = step(s)  # back: its first block hits the prefix cache, [4, 8) reads the image still cached
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_encoder_inputs == {}
    assert s.requests["a"].num_cached_tokens == 0 and s.requests["a"].num_computed_tokens == 8
    assert s.encoder_cache.num_references("i1") == 1  # still inside the image
    s.abort_requests(["a"])
    assert s.encoder_cache.num_references("i1") == 0
    s.add_request(mm_request("b", [("i2", 0, 8)], 10))
    so = step(s)
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.free_encoder_mm_hashes == ["i1"]
    assert "i1" not in s.encoder_cache


def test_full_cache_of_referenced_entries_makes_the_next_item_wait() -> None:
    s = make(budget=12, cache=8)
    s.add_request(mm_request("a", [("i1", 0, 8)], 16, max_tokens=5))
    s.add_request(mm_request("b", [("i2", 4, 8)], 14))
    so = step(s)
    # a's chunk [0, 12) covers i1, which fills the cache; b's image must wait for a to compute past i1
    assert so.num_scheduled_tokens == {"a": 12} and so.scheduled_encoder_inputs == {"a": [0]}
    so = step(s)
    # a computed past i1: it is evicted for b's image
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.free_encoder_mm_hashes == ["i1"]
    assert so.num_scheduled_tokens == {"a": 4, "b": 8}


def test_encoder_cache_manager_alone() -> None:
    m = EncoderCacheManager(10)
    r1 = mm_request("r1", [("x", 0, 6)], 8)
    r2 = mm_request("r2", [("y", 0, 6)], 8)
    assert m.can_allocate(6)
    m.allocate(r1, "x", 6)
    assert not m.can_allocate(6)  # x is referenced
    m.release(r1)
    assert m.can_allocate(6)
    m.allocate(r2, "y", 6)
    assert m.take_freed() == ["x"] and "x" not in m and m.num_used == 6


def test_block_keys_mix_in_image_hashes() -> None:
    layout = [("a", 4, 8)]
    same = mm_request("r1", layout, 16).block_hashes
    again = mm_request("r2", layout, 16).block_hashes
    other = mm_request("r3", [("b", 4, 8)], 16).block_hashes
    assert same == again  # a repeated image hits
    # the text block before the image is shared; the image's blocks and everything after differ
    assert same[0] == other[0] and all(x != y for x, y in zip(same[1:], other[1:]))
    # the front end's hashes are the core's
    r = mm_request("r4", layout, 16)
    assert prompt_block_hashes(r.prompt_token_ids, BLOCK, None, None,
                               MultiModalInputs(r.mm_features)) == r.block_hashes


def test_prefix_cache_hit_only_for_the_same_image() -> None:
    s = make(budget=64)
    s.add_request(mm_request("a", [("img", 4, 8)], 17))
    step(s)
    s.add_request(mm_request("b", [("img", 4, 8)], 17))
    s.add_request(mm_request("c", [("other", 4, 8)], 17))
    step(s)
    assert s.requests["b"].num_cached_tokens == 16  # all 4 full blocks
    assert s.requests["c"].num_cached_tokens == 4  # only the text block before the image


def test_withdrawn_request_hands_its_encoding_over_or_forgets_it() -> None:
    from pagoda.scheduler.scheduler import _StepBuilder

    s = make(budget=64)
    a, b, c = (mm_request("a", [("shared", 0, 8)], 10), mm_request("b", [("shared", 2, 8)], 12),
               mm_request("c", [("own", 0, 8)], 10))
    for r in (a, b, c):
        s.requests[r.request_id] = r
    step = _StepBuilder(64, 8, encoder_budget=64)
    for r in (a, b, c):
        n, encode = s._encoder_inputs(r, 0, r.num_tokens, step)
        step.take(r.request_id, n)
        s._commit_encoder_inputs(r, 0, n, encode, step)
    assert step.encoder_inputs == {"a": [0], "c": [0]}
    # (priority preemption of a request already in the step) a's encoding moves to b, which reads it too
    s._unschedule("a", step)
    assert step.encoder_inputs == {"b": [0], "c": [0]} and "shared" in s.encoder_cache
    # c alone read its image: the entry is forgotten, never computed
    s._unschedule("c", step)
    assert "c" not in step.encoder_inputs and "own" not in s.encoder_cache
    assert step.encoder_budget == 64 - 8


def test_masked_placeholders_count_encoder_outputs() -> None:
    # two items whose 10-token spans hold 4 encoder outputs each (Idefics3's tile tags among its <image>
    # tokens): an encoder budget of 8 takes both in one step, and the cache holds 4 per item
    s = make(budget=64, encoder_budget=8, cache=8)
    mask = (False, True, True, False, False, True, True, False, False, False)
    ids = [1 + i % 50 for i in range(24)]
    mm = MultiModalInputs([MultiModalFeature("image", ident, PlaceholderRange(off, 10, mask), {"pixel_values": torch.zeros(1)})
                           for ident, off in (("i1", 1), ("i2", 12))])
    s.add_request(Request("a", ids, SamplingParams(max_tokens=2), eos_token_id=0, block_size=BLOCK, mm=mm))
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 24} and so.scheduled_encoder_inputs == {"a": [0, 1]}
    assert s.encoder_cache.num_used == 8
