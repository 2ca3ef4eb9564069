"""Scheduler: token budget, max_num_seqs, chunked prefill, priority order, preemption, abort."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.kv_cache.manager import KVCacheManager
from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler

BLOCK = 4


@dataclass
class Params:
    max_tokens: int = 4
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


def make_scheduler(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, policy: str = "fcfs",
                   chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                     enable_chunked_prefill=chunked, policy=policy)


def req(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), Params(max_tokens=max_tokens), eos_token_id=0,
                   block_size=BLOCK, arrival_time=arrival, priority=priority)


def run_step(s: Scheduler, token: int = 7):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[token] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    return so, s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))


def test_budget_and_chunked_prefill() -> None:
    s = make_scheduler(budget=16)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, first=100))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}  # b gets the rest of the budget as a chunk
    assert so.total_num_scheduled_tokens == 16
    so, outs = run_step(s)
    # a decodes one token, b finishes its prompt
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert {o.req_id for o in outs} == {"a", "b"}


def test_no_chunking_waits_for_room() -> None:
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, first=100))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10}


def test_max_num_seqs() -> None:
    s = make_scheduler(max_seqs=2, budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, first=10 * i + 1))
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert s.num_waiting == 2


def test_priority_policy_admits_lowest_value_first() -> None:
    s = make_scheduler(max_seqs=2, policy="priority", budget=64)
    s.add_request(req("late-low", 3, priority=5, arrival=1.0))
    s.add_request(req("high", 3, priority=-1, arrival=2.0, first=20))
    s.add_request(req("mid", 3, priority=0, arrival=3.0, first=40))
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["high", "mid"]


def test_preemption_frees_blocks_and_recomputes_newest_first() -> None:
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens grow until one is preempted
    s = make_scheduler(num_blocks=7, budget=64, max_seqs=4)
    s.add_request(req("old", 8, max_tokens=12, arrival=0.0))
    s.add_request(req("new", 8, max_tokens=12, arrival=1.0, first=50))
    preempted_seen = False
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        run_step(s)
        if not preempted_seen and s.requests.get("new") is not None and s.requests["new"].status == RequestStatus.PREEMPTED:
            preempted_seen = True
            # the newest request is the victim; the older one keeps running
            assert s.requests["old"].status == RequestStatus.RUNNING
    assert preempted_seen and s.num_preemptions >= 1
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_abort_running_and_waiting_frees_blocks() -> None:
    s = make_scheduler(max_seqs=1, budget=64)
    s.add_request(req("run", 9))
    s.add_request(req("wait", 9, first=40))
    run_step(s)
    assert s.kv.num_free_blocks < s.kv.num_usable_blocks
    s.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    so = s.schedule()
    assert so.finished_req_ids == {"run"}  # the runner is told to forget the one it held


def test_stop_conditions() -> None:
    s = make_scheduler()
    r = req("eos", 3, max_tokens=10)
    r.sampling_params.min_tokens = 2
    s.add_request(r)
    _, outs = run_step(s, token=0)  # EOS before min_tokens: not a stop
    assert outs[0].finish_reason is None
    _, outs = run_step(s, token=0)
    assert outs[0].finish_reason == "stop"
    s.add_request(req("len", 3, max_tokens=2, first=30))
    run_step(s)
    _, outs = run_step(s)
    assert outs[0].finish_reason == "length"
