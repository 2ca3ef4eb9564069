"""Scheduler with several batches in flight (pipeline parallelism's batch queue): a request a batch in
flight holds is not scheduled again, outputs are applied in order, abort / preemption / a reused id while
a batch runs, the even split of the live requests over the micro-batches, and the output tokens handed
back to the stages before the last."""

from __future__ import annotations

from pagoda.kv_cache.manager import KVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler

BLOCK = 4


def make(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16, use_pp: bool = False,
         micro_batches: int = 1) -> Scheduler:
    s = Scheduler(KVCacheManager(num_blocks, BLOCK, enable_caching=False), max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, max_model_len=256, use_pp=use_pp)
    s.num_micro_batches = micro_batches
    return s


def req(rid: str, n: int, first: int = 1, max_tokens: int = 16) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=None, block_size=BLOCK)


def output_of(s: Scheduler, so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a runner returns for ``so``: a token for each request whose scheduled tokens reach its end."""
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests.get(rid)
        sampled.append([token] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def test_a_request_in_flight_is_not_scheduled_again_and_outputs_apply_in_order() -> None:
    s = make(budget=12)
    s.add_request(req("a", 4))
    s.add_request(req("b", 20, first=50))  # a chunked prompt: 8 tokens now, 12 next
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4, "b": 8}
    out_first = output_of(s, first)
    # a waits for its sampled token, b's next chunk waits for its first chunk: nothing to schedule
    assert s.schedule().is_empty
    s.add_request(req("c", 3, first=90))
    second = s.schedule()
    assert second.num_scheduled_tokens == {"c": 3}
    out_second = output_of(s, second)
    assert [o.req_id for o in s.update_from_output(first, out_first)] == ["a"]
    third = s.schedule()  # c is still in flight
    assert third.num_scheduled_tokens == {"a": 1, "b": 11}
    assert [o.req_id for o in s.update_from_output(second, out_second)] == ["c"]
    assert s.requests["a"].output_token_ids == [7] and s.requests["c"].output_token_ids == [7]


def test_the_live_requests_are_split_evenly_over_the_micro_batches() -> None:
    s = make(micro_batches=2)
    for i in range(8):
        s.add_request(req(f"r{i}", 3, first=10 * i + 1))
    a = s.schedule()
    b = s.schedule()
    assert list(a.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]
    assert list(b.num_scheduled_tokens) == ["r4", "r5", "r6", "r7"]
    s.update_from_output(a, output_of(s, a))
    a2 = s.schedule()  # the first micro-batch comes back as one
    assert list(a2.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]
    assert s.schedule().is_empty  # the rest are in flight
    # one batch in flight: every live request in one step
    one = make(micro_batches=1)
    for i in range(8):
        one.add_request(req(f"r{i}", 3, first=10 * i + 1))
    assert len(one.schedule().num_scheduled_tokens) == 8


def test_abort_in_flight_drops_the_output_and_a_reused_id_waits_for_the_old_batch() -> None:
    s = make()
    s.add_request(req("a", 4))
    s.add_request(req("b", 4, first=20))
    so = s.schedule()
    out = output_of(s, so)
    s.abort_requests(["a"])
    assert s.kv.usage < 1 and "a" not in s.requests
    s.add_request(req("a", 5, first=40))  # the same id, a new request, while the old batch runs
    nxt = s.schedule()
    assert nxt.is_empty and nxt.finished_req_ids == {"a"}  # the runner forgets the old one first
    outs = s.update_from_output(so, out)
    assert [o.req_id for o in outs] == ["b"]
    assert s.requests["a"].output_token_ids == [] and s.requests["a"].status == RequestStatus.WAITING
    again = s.schedule()
    assert [n.req_id for n in again.scheduled_new_reqs] == ["a"] and again.scheduled_new_reqs[0].token_ids[0] == 40


def test_a_request_preempted_in_flight_comes_back_only_after_its_batch() -> None:
    # two usable blocks of 4 tokens (the pool keeps one back); a and b (4 prompt tokens each) run in
    # separate micro-batches
    s = make(num_blocks=3, micro_batches=2)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4, first=30))
    first = s.schedule()
    second = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4} and second.num_scheduled_tokens == {"b": 4}
    s.update_from_output(first, output_of(s, first))
    # a's 5th token needs a block: b, the newest running request, is preempted while its batch runs
    third = s.schedule()
    b = s.requests["b"]
    assert third.num_scheduled_tokens == {"a": 1} and third.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    s.abort_requests(["a"])  # every block is free now, yet b must wait for its batch in flight
    assert s.schedule().is_empty
    # its batch's (stale) token is dropped
    assert s.update_from_output(second, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[99]])) == []
    assert b.output_token_ids == [] and b.status == RequestStatus.PREEMPTED
    s.update_from_output(third, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))  # a was aborted
    back = s.schedule()
    assert [(n.req_id, n.token_ids, n.num_computed_tokens) for n in back.scheduled_new_reqs] == [("b", [30, 31, 32, 33], 0)]


def test_the_stages_before_the_last_get_the_sampled_tokens_with_the_step_that_computes_them() -> None:
    s = make(budget=8, use_pp=True)
    s.add_request(req("a", 3))
    s.add_request(req("b", 10, first=20))  # prompt in two chunks
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 3, "b": 5}
    s.update_from_output(first, output_of(s, first, token=11))
    second = s.schedule()
    got = {d.req_id: d.scheduled_output_token_ids for d in second.scheduled_cached_reqs}
    assert got == {"a": [11], "b": []}  # a decodes its sampled token; b's chunk is all prompt
    s.update_from_output(second, output_of(s, second, token=12))
    third = s.schedule()
    got = {d.req_id: d.scheduled_output_token_ids for d in third.scheduled_cached_reqs}
    assert got == {"a": [12], "b": [12]}
    s = make()
    s.add_request(req("a", 3))
    s.update_from_output(first := s.schedule(), output_of(s, first, token=11))
    assert [d.scheduled_output_token_ids for d in s.schedule().scheduled_cached_reqs] == [None]  # not without use_pp


def test_discard_batch_frees_its_requests() -> None:
    s = make()
    s.add_request(req("a", 4))
    so = s.schedule()
    assert s.in_flight_request_ids() == ["a"]
    s.discard_batch(so)
    assert s.in_flight_request_ids() == [] and not s._in_flight
