"""The rejection sampler keeps the target distribution exactly (chi-square over many rows), greedy rows
accept exactly the argmax prefix, and a planted bug (accept every draft) is caught by the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from pagoda.sample import Sampler, SamplingBatch
from pagoda.sample import rejection
from pagoda.sample.rejection import rejection_sample
from pagoda.sampling_params import SamplingParams

TOY_LOGITS = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0])
VOCAB = len(TOY_LOGITS)
ROWS = 4000


def _batch(params: SamplingParams, rows: int) -> SamplingBatch:
    batch = SamplingBatch(rows, VOCAB)
    for r in range(rows):
        batch.add_request(r, params, [0], [])
    return batch


def _first_tokens(params: SamplingParams, draft: int, rows: int = ROWS) -> np.ndarray:
    """Each request drafts ``draft`` then has its bonus row: -> the first output token of each."""
    batch = _batch(params, rows)
    logit_rows = np.repeat(np.arange(rows), 2)
    metadata = batch.metadata(logit_rows, [[], [draft]] * rows)
    logits = TOY_LOGITS.repeat(2 * rows, 1)
    drafts = torch.tensor([draft, -1] * rows)
    out = rejection_sample(Sampler(), logits, metadata, drafts, np.ones(rows, dtype=np.int64))
    assert all(1 <= len(t) <= 2 for t in out.token_ids)
    assert all((len(t) == 2) == (t[0] == draft) for t in out.token_ids), "a draft is accepted, or replaced"
    return np.array([t[0] for t in out.token_ids])


def _target(params: SamplingParams) -> np.ndarray:
    logits = TOY_LOGITS.double().numpy() / params.temperature
    probs = np.exp(logits - logits.max())
    if params.top_k > 0:
        probs[np.argsort(-probs)[params.top_k:]] = 0
    return probs / probs.sum()


def _p_value(tokens: np.ndarray, expected: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=VOCAB)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token outside the target's support was drawn"
    expected = expected[keep] / expected[keep].sum()
    return float(stats.chisquare(observed[keep], expected * len(tokens)).pvalue)


@pytest.mark.parametrize("params,draft", [
    (SamplingParams(temperature=1.0, seed=None), 0),  # the likeliest token drafted
    (SamplingParams(temperature=0.7), 5),  # an unlikely one
    (SamplingParams(temperature=1.3, top_k=4), 2),  # inside the truncated support
    (SamplingParams(temperature=1.0, top_k=3), 7),  # outside it: never accepted
])
def test_output_distribution_is_the_target(params: SamplingParams, draft: int) -> None:
    torch.manual_seed(0)
    tokens = _first_tokens(params, draft)
    assert _p_value(tokens, _target(params)) > 1e-3


def test_planted_bug_accepting_every_draft_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # u = 0 accepts each draft the target gives any probability: the output is the draft every time
    monkeypatch.setattr(rejection, "_uniforms", lambda n, generators, device: torch.zeros(n, device=device))
    params = SamplingParams(temperature=1.0)
    tokens = _first_tokens(params, 3)
    assert _p_value(tokens, _target(params)) < 1e-6


def test_greedy_accepts_the_argmax_prefix() -> None:
    # three requests: drafts agreeing with the argmax (0) for 2, 1 and 0 positions
    params = SamplingParams(temperature=0.0)
    batch = _batch(params, 3)
    drafts = [[0, 0], [0, 4, 0], [3]]
    num_draft = np.array([len(d) for d in drafts])
    logit_rows = np.repeat(np.arange(3), num_draft + 1)
    metadata = batch.metadata(logit_rows, [d[:j] for d in drafts for j in range(len(d) + 1)])
    ids = torch.tensor([t for d in drafts for t in (*d, -1)])
    out = rejection_sample(Sampler(), TOY_LOGITS.repeat(len(ids), 1), metadata, ids, num_draft)
    assert out.token_ids == [[0, 0, 0], [0, 0], [0]]


def test_penalties_see_the_drafts_before_each_position() -> None:
    """A strong frequency penalty: after drafting token 0 twice, the target at the third position avoids 0,
    so a third draft 0 is rejected even greedily and replaced by the next best (1)."""
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    batch = _batch(params, 1)
    drafts = [[0, 1, 0]]
    metadata = batch.metadata(np.zeros(4, dtype=np.int64), [[], [0], [0, 1], [0, 1, 0]])
    ids = torch.tensor([0, 1, 0, -1])
    out = rejection_sample(Sampler(), TOY_LOGITS.repeat(4, 1), metadata, ids, np.array([3]))
    # position 1: 0 penalised by 1.5 -> 0.5 < 1.6: argmax 1 = the draft; position 2: 0 -> 0.5, 1 -> 0.1,
    # 2 -> 1.2 wins over the draft 0
    assert out.token_ids == [[0, 1, 2]]


def test_seeded_rows_repeat() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)

    def run() -> list[list[int]]:
        batch = _batch(params, 2)
        metadata = batch.metadata(np.repeat(np.arange(2), 3), [[], [5], [5, 6]] * 2)
        ids = torch.tensor([5, 6, -1] * 2)
        return rejection_sample(Sampler(), TOY_LOGITS.repeat(6, 1), metadata, ids, np.array([2, 2])).token_ids

    torch.manual_seed(1)
    first = run()
    torch.manual_seed(2)
    assert run() == first
