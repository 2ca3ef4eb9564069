"""SpecDecoding's rules on real scheduler requests: draft lengths capped by max_tokens and the context,
disable_by_batch_size, the adaptive length and its pause, the counters, per-request proposers."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request
from pagoda.spec_decode import DraftRequest, Proposer, SpeculativeConfig
from pagoda.spec_decode.scheduling import SpecDecoding


class CountingProposer(Proposer):
    """Drafts ``max_num_tokens`` copies of the request's last token; remembers what it was asked."""

    name = "counting"

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.asked: list[tuple[str, int]] = []
        self.observed: list[tuple[str, int, int]] = []
        self.finished: list[str] = []

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.asked += [(r.req_id, r.max_num_tokens) for r in requests]
        return [[r.token_ids[-1]] * r.max_num_tokens for r in requests]

    def observe(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.observed.append((req_id, num_draft_tokens, num_accepted_tokens))

    def on_finished(self, req_id: str) -> None:
        self.finished.append(req_id)


def _config(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=4, **kw)


def _request(rid: str, num_prompt: int = 5, max_tokens: int | None = 100) -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens), None, block_size=16)


def test_draft_length_caps() -> None:
    proposer = CountingProposer(_config())
    spec = SpecDecoding(_config(), proposer, max_model_len=12)
    near_max_tokens = _request("a", max_tokens=3)
    near_context = _request("b", num_prompt=9)
    done = _request("c", max_tokens=1)
    free = _request("d")
    spec.propose([near_max_tokens, near_context, done, free], num_running=4)
    # room for the drafts and the verify step's own token: max_tokens 3 -> 2, context 12 - 9 -> 2
    assert proposer.asked == [("a", 2), ("b", 2), ("d", 4)]
    assert free.spec_token_ids == [4, 4, 4, 4] and done.spec_token_ids == []


def test_disable_by_batch_size() -> None:
    proposer = CountingProposer(_config(disable_by_batch_size=2))
    spec = SpecDecoding(_config(disable_by_batch_size=2), proposer, max_model_len=100)
    reqs = [_request(str(i)) for i in range(3)]
    spec.propose(reqs, num_running=3)
    assert proposer.asked == [] and all(not r.spec_token_ids for r in reqs)
    spec.propose(reqs[:2], num_running=2)
    assert len(proposer.asked) == 2


def test_adaptive_length_and_pause() -> None:
    proposer = CountingProposer(_config())
    spec = SpecDecoding(_config(), proposer, max_model_len=100)
    req = _request("a")
    spec.record(req, 4, 1)  # mean accepted 1 -> next draft at most 2
    spec.propose([req], 1)
    assert proposer.asked[-1] == ("a", 2)
    spec.record(req, 2, 2)  # mean 1.5 -> 3
    spec.propose([req], 1)
    assert proposer.asked[-1] == ("a", 3)
    for _ in range(6):
        spec.record(req, 3, 0)  # the mean falls below 0.1: paused
    asked = len(proposer.asked)
    for _ in range(8):
        spec.propose([req], 1)
    assert len(proposer.asked) == asked, "paused for 8 steps"
    spec.propose([req], 1)
    assert proposer.asked[-1] == ("a", 1), "back at one token after the pause"
    stats = spec.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (8, 24, 3)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 0, 0]
    assert spec.take_stats() is None
    assert proposer.observed[0] == ("a", 4, 1)
    spec.on_finished(req)
    assert proposer.finished == ["a"]


def test_a_request_with_its_own_proposer_is_asked_instead() -> None:
    engine_proposer = CountingProposer(_config())
    own = CountingProposer(_config())
    spec = SpecDecoding(_config(), engine_proposer, max_model_len=100)
    a, b = _request("a"), _request("b")
    b.spec_proposer = own
    spec.propose([a, b], 2)
    assert [rid for rid, _ in engine_proposer.asked] == ["a"]
    assert [rid for rid, _ in own.asked] == ["b"]
    spec.record(b, 4, 4)
    assert own.observed == [("b", 4, 4)] and not engine_proposer.observed
