"""The rejection sampler: verifies a step's draft tokens against the target model, exactly.

Each verified request has ``k`` drafts and ``k + 1`` logits rows: row ``j`` is the target's distribution
for the token after draft ``j - 1`` (row 0: after the request's last real token), computed as the sampler
would (constraints, penalties, bias, temperature, min-p, top-k/p; ``SamplingBatch.metadata`` gives the row
of draft ``j`` the output extended by drafts ``0..j-1``).

* greedy rows accept draft ``j`` while it equals the target's argmax; the first mismatch is replaced by
  the argmax; all accepted, the last row's argmax is the bonus token.
* random rows use the accept/resample rule of Leviathan et al. / Chen et al. with a point-mass draft
  (the n-gram and suffix proposers have no draft distribution): accept ``t`` with probability
  ``p(t)``; else sample from ``p`` with ``t`` removed, renormalised. Then a token leaves row ``j`` with
  probability ``p(t) * [t = draft] + (1 - p(draft)) * p(t) / (1 - p(draft)) * [t != draft] = p(t)``:
  the output distribution is the target's. All accepted, the bonus is sampled from the last row.

Uniforms and resampling noise of a seeded request come from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.sample.constraints import apply_constraints
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.output import LogprobsTensors
from pagoda.sample.sampler import Sampler, argmax_rows, exponential_race


@dataclass
class RejectionOutput:
    # per request: the accepted drafts, then the target's own token
    token_ids: list[list[int]]
    # per logits row: the row's output token (accepted draft, correction or bonus) and its logprobs; rows
    # past a request's first rejection hold a token that was not output
    logprobs_tensors: LogprobsTensors | None
    # per request: the first of its logits rows
    first_rows: np.ndarray


def _uniforms(n: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    u = torch.rand(n, device=device)
    for row, generator in generators.items():
        u[row] = torch.rand((), device=device, generator=generator)
    return u


def rejection_sample(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata,
                     draft_token_ids: torch.Tensor, num_draft: np.ndarray) -> RejectionOutput:
    """``logits`` [N, V] (``N = sum(num_draft + 1)``, each request's rows together); ``draft_token_ids`` [N]
    int64, the draft each row verifies (-1 on each request's last row); ``metadata`` one entry per row."""
    wants_logprobs = metadata.max_num_logprobs is not None
    logits = logits.to(torch.float32)
    raw = sampler.raw_values(logits) if wants_logprobs else None
    if metadata.needs_constraints:
        apply_constraints(logits, metadata)
    is_draft = draft_token_ids >= 0
    safe_draft = draft_token_ids.clamp(min=0)

    greedy_tok = None if metadata.all_random else argmax_rows(logits)
    if metadata.all_greedy:
        assert greedy_tok is not None
        accepted, chosen = is_draft & (draft_token_ids == greedy_tok), greedy_tok
        values_logits = logits
    else:
        logits = Sampler._truncate(logits, metadata)
        values_logits = logits
        probs = logits.softmax(dim=-1)
        p_draft = probs.gather(1, safe_draft.unsqueeze(1)).squeeze(1)
        u = _uniforms(len(probs), metadata.generators, probs.device)
        accepted = is_draft & (u < p_draft)
        # resample from p without the draft (the exponential race needs no renormalising)
        rows = torch.nonzero(is_draft).squeeze(1)
        probs.index_put_((rows, safe_draft[rows]), torch.zeros((), device=probs.device))
        chosen = exponential_race(probs, metadata.generators, sampler._cpu_rng(probs))
        if greedy_tok is not None:
            assert metadata.greedy_mask is not None
            accepted = torch.where(metadata.greedy_mask, is_draft & (draft_token_ids == greedy_tok), accepted)
            chosen = torch.where(metadata.greedy_mask, greedy_tok, chosen)
    out_tokens = torch.where(accepted, draft_token_ids, chosen)

    counts = num_draft + 1
    first_rows = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    acc = accepted.cpu().numpy()
    toks = out_tokens.cpu().numpy()
    # each request's first rejected row (its last row never accepts: it has no draft)
    rejected = np.flatnonzero(~acc)
    first_rejected = np.full(len(counts), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_rejected, np.searchsorted(first_rows, rejected, side="right") - 1, rejected)
    token_ids = [toks[s: e + 1].tolist() for s, e in zip(first_rows.tolist(), first_rejected.tolist())]

    logprobs_tensors = sampler.logprobs(raw, values_logits, metadata, out_tokens) if wants_logprobs else None
    return RejectionOutput(token_ids, logprobs_tensors, first_rows)
