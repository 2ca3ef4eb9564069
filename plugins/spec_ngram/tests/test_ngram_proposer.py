"""The n-gram proposer against a plain per-request reference: the longest n in [min, max] whose last n
tokens occur earlier wins, the latest occurrence of it, and the tokens after it (at most k, never past the end)."""

from __future__ import annotations

import random

from pagoda.spec_decode import DraftRequest, SpeculativeConfig
from pagoda_spec_ngram.proposer import NgramProposer


def _reference(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest first; the match must be followed by a token
            if tokens[end - n + 1: end + 1] == suffix:
                return tokens[end + 1: end + 1 + k]
    return []


def test_matches_the_reference_over_a_growing_batch() -> None:
    rng = random.Random(0)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
    proposer = NgramProposer(config)
    seqs = {f"r{i}": [rng.randrange(6) for _ in range(rng.randint(1, 30))] for i in range(20)}
    for step in range(15):
        live = [rid for rid in seqs if (hash(rid) + step) % 4]
        requests = [DraftRequest(rid, seqs[rid], 1, 1 + (step + i) % 5) for i, rid in enumerate(live)]
        got = proposer.propose(requests)
        for r, draft in zip(requests, got):
            assert draft == _reference(list(r.token_ids), 2, 4, r.max_num_tokens), (r.req_id, step)
        for rid in live:
            seqs[rid].extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
        if step == 7:
            # finished requests free their rows; new ones reuse them
            for rid in live[:5]:
                proposer.on_finished(rid)
                seqs.pop(rid)
            for i in range(5):
                seqs[f"new{i}"] = [rng.randrange(6) for _ in range(rng.randint(1, 50))]


def test_defaults_and_no_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert (proposer.n_min, proposer.n_max) == (5, 5)
    assert proposer.propose([DraftRequest("a", [1, 2, 3, 4], 4, 3)]) == [[]]
