"""Scheduler: token budget, max_num_seqs, chunked prefill, priority order, preemption, abort, beam search hooks."""

from __future__ import annotations

from pagoda.beam_search.group import BeamGroup, beam_request_params
from pagoda.beam_search.scheduling import NO_BEAM_SEARCH, BeamSearchScheduling
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.engine.messages import EngineCoreOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler

BLOCK = 4


def make_scheduler(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, policy: str = "fcfs",
                   chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                     enable_chunked_prefill=chunked, policy=policy)


def req(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), eos_token_id=0,
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


# -- beam search: the component the scheduler calls at its named points ---------------

def start_group(s: Scheduler, gid: str, width: int, max_tokens: int, prompt_len: int = 6) -> BeamGroup:
    prompt = list(range(1, 1 + prompt_len))
    group = BeamGroup(group_id=gid, prompt_token_ids=prompt, beam_width=width, max_tokens=max_tokens, eos_token_id=None)
    root = Request(group.new_beam_id(), prompt, beam_request_params(), None, BLOCK)
    s.add_beam_search(group, root)
    return group


def beam_step(s: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One step: sampling rows get token 7; beam rows report 4 candidates (tokens 20-23, best first)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    candidates: dict[str, tuple[list[int], list[float]]] = {}
    for rid in ids:
        r = s.requests[rid]
        done = r.num_computed_tokens >= r.num_tokens
        if r.beam_group is not None:
            sampled.append([])
            if done:
                candidates[rid] = ([20, 21, 22, 23], [-0.1, -0.2, -0.3, -0.4])
        else:
            sampled.append([7] if done else [])
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, beam_candidates=candidates or None)
    return so, s.update_from_output(so, out)


def test_plain_scheduler_holds_the_no_op_component_until_a_beam_search() -> None:
    s = make_scheduler()
    s.add_request(req("plain", 5))
    beam_step(s)
    assert s.beam_search is NO_BEAM_SEARCH
    start_group(s, "g", width=2, max_tokens=3)
    assert isinstance(s.beam_search, BeamSearchScheduling)


def test_group_forks_sharing_blocks_and_finishes_with_its_beams() -> None:
    s = make_scheduler(num_blocks=32)
    kv: KVCacheManager = s.kv
    group = start_group(s, "g", width=2, max_tokens=3)
    so, outs = beam_step(s)  # the root's prompt: it reports candidates, the group forks it
    assert outs == [] and len(group.beam_ids) == 2
    root, child = (s.requests[b] for b in group.beam_ids)
    assert root.output_token_ids == [20] and child.output_token_ids == [21]
    # the child shares every block of the root until one of them writes
    assert kv.get_block_ids(child.request_id) == kv.get_block_ids(root.request_id)
    so, outs = beam_step(s)
    new_ids = [n.req_id for n in so.scheduled_new_reqs]
    assert new_ids == [child.request_id]  # the runner gets the fork whole
    assert so.scheduled_new_reqs[0].beam.num_candidates == 2 * group.beam_width
    assert [d.new_token_ids for d in so.scheduled_cached_reqs] == [[20]]  # the root's token chosen by the group
    while not outs:
        so, outs = beam_step(s)
    (done,) = outs
    assert done.req_id == "g" and done.finish_reason == "length"
    assert [b.token_ids for b in done.beam_sequences] == [[20, 20, 20], [20, 20, 21]]
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_admitted_group_keeps_rows_reserved_for_its_width() -> None:
    s = make_scheduler(max_seqs=3, budget=36)
    start_group(s, "g", width=3, max_tokens=4, prompt_len=40)
    s.add_request(req("late", 4, first=100))
    so, _ = beam_step(s)
    # the root's prompt takes two steps; its group holds two more rows meanwhile
    assert so.num_scheduled_tokens == {"g#beam0": 36}
    assert s.beam_search.reserved_rows() == 2
    so, _ = beam_step(s)
    # budget is left, but no row: the plain request waits
    assert so.num_scheduled_tokens == {"g#beam0": 4}
    assert len(s.running) == 3 and s.beam_search.reserved_rows() == 0


def test_abort_by_group_id_frees_every_beam() -> None:
    s = make_scheduler(num_blocks=32)
    group = start_group(s, "g", width=3, max_tokens=8)
    beam_step(s)
    beam_step(s)
    assert len(group.beam_ids) == 3
    s.abort_requests(["g"])
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    assert s.beam_search.groups == {}


def test_a_constrained_request_waits_for_its_grammar_without_holding_up_others() -> None:
    from concurrent.futures import Future

    from pagoda.structured_output.manager import RequestStructuredOutput
    from pagoda.structured_output.params import StructuredOutputsParams

    s = make_scheduler()
    grammar: Future = Future()
    constrained = req("c", 4)
    constrained.structured_output = RequestStructuredOutput(StructuredOutputsParams(regex="a"), grammar)
    s._compiling.append(constrained)  # as add_request does while the grammar compiles
    s.requests["c"] = constrained
    s.add_request(req("plain", 4, arrival=1.0))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["plain"]
    # aborting a request that is still compiling
    s.abort_requests(["c"])
    assert "c" not in s.requests and not s._compiling
    # a failed compile finishes the request with an error output, never in a step
    failed: Future = Future()
    failed.set_exception(ValueError("bad regex"))
    broken = req("b", 4)
    broken.structured_output = RequestStructuredOutput(StructuredOutputsParams(regex="a"), failed)
    s._compiling.append(broken)
    s.requests["b"] = broken
    s.schedule()
    outputs = s.take_pending_outputs()
    assert [(o.req_id, o.finish_reason, o.stop_reason) for o in outputs] == [("b", "error", "bad regex")]
    assert "b" not in s.requests
