"""Predicted outputs (OpenAI's ``prediction``): a per-request proposer drafting from the text a client expects.

The prediction is the expected output (the code-edit case: the file before the edit). The proposer keeps a
cursor into it: while the output follows the prediction the cursor advances and the next tokens after it are
the draft. When an output token differs (an edit), drafting stops until the output re-joins the prediction:
the last few output tokens are looked for in the prediction ahead of the cursor, and the cursor moves past
the first place they occur (an insertion re-joins where it left, a deletion further on).

It counts what OpenAI reports in ``usage.completion_tokens_details``: accepted prediction tokens (drafts the
target model accepted) and rejected ones (prediction tokens that never appeared in the output at their
place: the prediction's length less the tokens the alignment matched).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.engine.messages import PredictionCounts
from pagoda.spec_decode.proposer import DraftRequest, Proposer

# How many of the latest output tokens must occur together in the prediction for the output to re-join it
# (one token re-joins on any common token such as a bracket or a space: a wrong cursor drafts for nothing).
_REJOIN_TOKENS = 3
# num_speculative_tokens for a prediction when the server runs without --speculative-config.
PREDICTION_NUM_SPECULATIVE_TOKENS = 8


class PredictionProposer(Proposer):
    """Drafts one request's next tokens from its prediction (built per request; ``propose`` sees only it)."""

    name = "prediction"

    def __init__(self, prediction_token_ids: Sequence[int]) -> None:
        # no SpeculativeConfig: the engine's (or the prediction-only default) sets the draft length
        self.prediction = list(prediction_token_ids)
        self.cursor = 0  # the prediction index the next output token is expected to equal
        self.aligned = True
        self.num_seen = 0  # output tokens consumed so far
        self.num_matched = 0
        self.num_accepted = 0

    @property
    def num_rejected(self) -> int:
        return max(len(self.prediction) - self.num_matched, 0)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = []
        for r in requests:
            self._follow(r.token_ids, r.num_prompt_tokens)
            drafts.append(self.prediction[self.cursor:self.cursor + r.max_num_tokens] if self.aligned else [])
        return drafts

    def observe(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_accepted += num_accepted_tokens

    def counts(self, token_ids: Sequence[int], num_prompt_tokens: int) -> PredictionCounts:
        """The request's counts, its latest tokens followed first."""
        self._follow(token_ids, num_prompt_tokens)
        return PredictionCounts(self.num_accepted, self.num_rejected)

    def _follow(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Move the cursor over the output tokens not seen yet."""
        pred = self.prediction
        start = num_prompt_tokens + self.num_seen
        for i in range(start, len(token_ids)):
            tok = token_ids[i]
            self.num_seen += 1
            if self.aligned and self.cursor < len(pred) and pred[self.cursor] == tok:
                self.cursor += 1
                self.num_matched += 1
                continue
            self.aligned = False
            m = min(_REJOIN_TOKENS, self.num_seen)
            j = _find(pred, list(token_ids[i + 1 - m:i + 1]), self.cursor)
            if j >= 0:
                self.aligned = True
                self.cursor = j + m
                self.num_matched += 1


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    """The first index >= start where ``needle`` occurs in ``haystack``, else -1."""
    first, m = needle[0], len(needle)
    end = len(haystack) - m
    i = start
    while i <= end:
        try:
            i = haystack.index(first, i, end + 1)
        except ValueError:
            return -1
        if haystack[i:i + m] == needle:
            return i
        i += 1
    return -1
