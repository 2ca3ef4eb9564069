"""The scheduler's side of speculative decoding: who gets drafts after a step, how many, and what was accepted.

After each step's tokens are appended the scheduler asks ``propose`` for the running requests ready to
decode; their drafts wait in ``Request.spec_token_ids`` and go out with the next step. ``record`` takes
each verified request's acceptance (metrics, the proposer's ``observe``, the adaptive length).

When speculation does not pay:
* ``disable_by_batch_size``: no drafts in a step with more running requests than that (a big batch is
  compute-bound already, and every rejected draft is a wasted position).
* per-request adaptive length: each request keeps a moving average of the drafts it had accepted; its
  next draft is at most one token longer than that average, and a request whose drafts keep being
  rejected pauses proposing for a while (then tries again at one token).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.spec_decode.proposer import DraftRequest, Proposer

if TYPE_CHECKING:
    from pagoda.scheduler.request import Request
    from pagoda.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# Moving average weight of the newest verify step.
_EMA_WEIGHT = 0.5
# Below this average of accepted drafts a request pauses proposing for _PAUSE_STEPS decodes.
_PAUSE_BELOW = 0.1
_PAUSE_STEPS = 8


@dataclass
class SpecDecodingStats:
    """vLLM's spec_decode counters since the last report."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


@dataclass(slots=True)
class _Acceptance:
    """A request's recent acceptance (for its adaptive draft length)."""

    mean_accepted: float
    paused: int = 0


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig | None, proposer: Proposer | None, max_model_len: int,
                 log_interval_s: float = 10.0, k: int | None = None) -> None:
        # config and proposer None: prediction-only mode (no --speculative-config): only requests carrying their
        # own proposer (a prediction) draft, ``k`` tokens at a time
        self.config = config
        self.proposer = proposer
        num_tokens = config.k if config is not None else k
        if num_tokens is None:
            raise ValueError("SpecDecoding without a SpeculativeConfig needs k")
        self.k: int = num_tokens
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(self.k)
        self.logging = SpecDecodingLogging(self.k, log_interval_s)
        self._acceptance: dict[str, _Acceptance] = {}

    def take_stats(self) -> SpecDecodingStats | None:
        """The counters since the last call (None when nothing was drafted), reset."""
        stats = self.stats
        if not stats.num_drafts:
            return None
        self.stats = SpecDecodingStats(self.k)
        return stats

    # -- proposing ---------------------------------------------------------------
    def propose(self, requests: Iterable[Request], num_running: int) -> None:
        """Set ``spec_token_ids`` of the requests that get drafts for their next step."""
        limit = self.config.disable_by_batch_size if self.config is not None else None
        if limit is not None and num_running > limit:
            return
        by_proposer: dict[int, tuple[Proposer, list[DraftRequest], list[Request]]] = {}
        for req in requests:
            n = self._draft_length(req)
            if n <= 0:
                continue
            proposer = req.spec_proposer or self.proposer
            if proposer is None:
                continue
            group = by_proposer.setdefault(id(proposer), (proposer, [], []))
            group[1].append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, n))
            group[2].append(req)
        for proposer, drafts, reqs in by_proposer.values():
            for req, draft, tokens in zip(reqs, drafts, proposer.propose(drafts), strict=True):
                req.spec_token_ids = list(tokens[: draft.max_num_tokens])

    def _draft_length(self, req: Request) -> int:
        """How many drafts ``req`` may take now: k, capped by its adaptive length, max_tokens and the context."""
        n = self.k
        seen = self._acceptance.get(req.request_id)
        if seen is not None:
            if seen.paused > 0:
                seen.paused -= 1
                return 0
            n = min(n, 1 + math.ceil(seen.mean_accepted))
        # room for the drafts and the token the verify step adds after them
        if req.max_tokens is not None:
            n = min(n, req.max_tokens - req.num_output_tokens - 1)
        return min(n, self.max_model_len - req.num_tokens - 1)

    # -- results -----------------------------------------------------------------
    def record(self, req: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.stats.observe(num_draft_tokens, num_accepted_tokens)
        self.logging.observe(num_draft_tokens, num_accepted_tokens)
        proposer = req.spec_proposer or self.proposer
        assert proposer is not None  # it drafted
        proposer.observe(req.request_id, num_draft_tokens, num_accepted_tokens)
        seen = self._acceptance.get(req.request_id)
        if seen is None:
            seen = self._acceptance[req.request_id] = _Acceptance(float(num_accepted_tokens))
        else:
            seen.mean_accepted += _EMA_WEIGHT * (num_accepted_tokens - seen.mean_accepted)
        if seen.mean_accepted < _PAUSE_BELOW:
            seen.paused = _PAUSE_STEPS
            seen.mean_accepted = 0.0  # back at one draft token after the pause

    def on_preempted(self, req: Request) -> None:
        req.spec_token_ids = []
        proposer = req.spec_proposer or self.proposer
        if proposer is not None:
            proposer.on_preempted(req.request_id)

    def on_finished(self, req: Request) -> None:
        self._acceptance.pop(req.request_id, None)
        proposer = req.spec_proposer or self.proposer
        if proposer is not None:
            proposer.on_finished(req.request_id)


class SpecDecodingLogging:
    """vLLM's periodic ``SpecDecoding metrics`` log line: mean acceptance length, throughputs, per-position
    acceptance rates, over the drafts verified since the previous line."""

    def __init__(self, num_spec_tokens: int, interval_s: float) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.interval_s = interval_s
        self._stats = SpecDecodingStats(num_spec_tokens)
        self._since = time.monotonic()

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self._stats.observe(num_draft_tokens, num_accepted_tokens)
        now = time.monotonic()
        if now - self._since >= self.interval_s:
            logger.info("%s", self.line(now - self._since))
            self._stats = SpecDecodingStats(self.num_spec_tokens)
            self._since = now

    def line(self, elapsed_s: float) -> str:
        s = self._stats
        drafts = max(s.num_drafts, 1)
        rates = ", ".join(f"{n / drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
        draft_rate = 100.0 * s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
        elapsed_s = max(elapsed_s, 1e-9)
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + s.num_accepted_tokens / drafts:.2f}, "
                f"Accepted throughput: {s.num_accepted_tokens / elapsed_s:.2f} tokens/s, "
                f"Drafted throughput: {s.num_draft_tokens / elapsed_s:.2f} tokens/s, "
                f"Accepted: {s.num_accepted_tokens} tokens, Drafted: {s.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {rates}, Avg Draft acceptance rate: {draft_rate:.1f}%")
