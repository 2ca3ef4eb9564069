"""Sampled frequencies match the truncated distribution (chi-square), masked tokens never drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from pagoda.sample import Sampler, SamplingBatch
from pagoda.sampling_params import SamplingParams

TOY_LOGITS = np.array([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0])
DRAWS_PER_CASE = 5000


def expected_distribution(params: SamplingParams) -> np.ndarray:
    """Written directly from the definitions, one token at a time."""
    logits = TOY_LOGITS / params.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.ones(len(probs), dtype=bool)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    order = np.argsort(-probs)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    if params.top_p < 1.0:
        # Renormalize over what survived min-p and top-k, then keep the smallest head reaching top_p.
        survivors = np.where(keep, probs, 0.0)
        survivors /= survivors.sum()
        mass_before = 0.0
        for token in order:
            if mass_before >= params.top_p:
                keep[token] = False
            mass_before += survivors[token]
    result = np.where(keep, probs, 0.0)
    return result / result.sum()


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.2, top_k=4),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05),
]


@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_match_truncated_distribution(seeded: bool) -> None:
    torch.manual_seed(0)
    rows = DRAWS_PER_CASE * len(CASES)
    batch = SamplingBatch(max_num_seqs=rows, vocab_size=len(TOY_LOGITS))
    for row in range(rows):
        params = CASES[row // DRAWS_PER_CASE]
        if seeded and row % 4 == 1:
            # Every other row carries its own generator: the seeded path must draw correctly too.
            params = params.clone()
            params.seed = row
        batch.add_request(row, params, [0], [])
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32).expand(rows, -1).contiguous()
    sampled = Sampler()(logits, batch.metadata(np.arange(rows))).sampled_token_ids.numpy()
    for case_index, params in enumerate(CASES):
        drawn = sampled[case_index * DRAWS_PER_CASE : (case_index + 1) * DRAWS_PER_CASE]
        counts = np.bincount(drawn, minlength=len(TOY_LOGITS))
        expected = expected_distribution(params)
        assert counts[expected == 0].sum() == 0, f"{params}: drew a masked token"
        live = expected > 0
        assert live.sum() < len(TOY_LOGITS) or case_index == 0
        result = stats.chisquare(counts[live], expected[live] * DRAWS_PER_CASE)
        assert result.pvalue > 1e-3, f"case {case_index}: counts {counts} vs expected {expected * DRAWS_PER_CASE}"


def test_seeded_draws_repeat_across_runs() -> None:
    def draw() -> list[int]:
        batch = SamplingBatch(max_num_seqs=64, vocab_size=len(TOY_LOGITS))
        for row in range(64):
            batch.add_request(row, SamplingParams(temperature=1.0, seed=100 + row), [0], [])
        logits = torch.tensor(TOY_LOGITS, dtype=torch.float32).expand(64, -1).contiguous()
        return Sampler()(logits, batch.metadata(range(64))).sampled_token_ids.tolist()

    first = draw()
    assert draw() == first
    assert len(set(first)) > 2
