"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the request's last n tokens.

The longest n in [prompt_lookup_min, prompt_lookup_max] that occurs earlier in the request's prompt +
output wins; among its occurrences the latest (the freshest context). The match is computed for the whole
batch at once over a persistent token table (one row per request, only new tokens copied in each step):
for each offset i < n, one comparison of the table shifted by i with each row's i-th last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagoda.spec_decode import DraftRequest, Proposer, SpeculativeConfig

_PAD = -1  # never a token id


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max
        self._table = np.full((8, 256), _PAD, dtype=np.int64)
        self._lens = np.zeros(8, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free: list[int] = list(range(7, -1, -1))

    # -- the token table --------------------------------------------------------
    def _row(self, req_id: str) -> int:
        row = self._rows.get(req_id)
        if row is None:
            if not self._free:
                old = len(self._lens)
                self._table = np.concatenate((self._table, np.full_like(self._table, _PAD)))
                self._lens = np.concatenate((self._lens, np.zeros(old, dtype=np.int64)))
                self._free = list(range(2 * old - 1, old - 1, -1))
            row = self._rows[req_id] = self._free.pop()
            self._lens[row] = 0
        return row

    def _sync(self, requests: Sequence[DraftRequest]) -> np.ndarray:
        """Copy each request's tokens not in its row yet; -> the rows."""
        rows = np.fromiter((self._row(r.req_id) for r in requests), dtype=np.int64, count=len(requests))
        longest = max(len(r.token_ids) for r in requests)
        if longest > self._table.shape[1]:
            width = max(longest, 2 * self._table.shape[1])
            grown = np.full((len(self._table), width), _PAD, dtype=np.int64)
            grown[:, : self._table.shape[1]] = self._table
            self._table = grown
        for row, r in zip(rows.tolist(), requests):
            seen = int(self._lens[row])
            n = len(r.token_ids)
            if n != seen:
                # only the tail is new (rejected drafts never entered token_ids, so nothing is rewritten)
                self._table[row, seen:n] = r.token_ids[seen:n]
                self._lens[row] = n
        return rows

    # -- proposing ----------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        if not requests:
            return []
        rows = self._sync(requests)
        lens = self._lens[rows]
        width = int(lens.max())
        tokens = self._table[rows, :width]
        batch = np.arange(len(rows))
        positions = np.arange(width)
        # a match ends at p and is followed by a token; p = len - 1 is the suffix itself
        can_end = positions[None, :] < (lens - 1)[:, None]
        matched = np.ones_like(can_end)
        best_n = np.zeros(len(rows), dtype=np.int64)
        best_end = np.zeros(len(rows), dtype=np.int64)
        for i in range(self.n_max):
            # the i-th last token of each row (none where the row is shorter)
            last = np.where(lens - 1 - i >= 0, tokens[batch, np.maximum(lens - 1 - i, 0)], -2)
            shifted = np.full_like(tokens, _PAD)
            shifted[:, i:] = tokens[:, : width - i]
            matched &= shifted == last[:, None]
            if i + 1 >= self.n_min:
                hits = matched & can_end
                found = hits.any(axis=1)
                best_n = np.where(found, i + 1, best_n)
                latest = width - 1 - np.argmax(hits[:, ::-1], axis=1)
                best_end = np.where(found, latest, best_end)
        k = np.fromiter((r.max_num_tokens for r in requests), dtype=np.int64, count=len(requests))
        k_max = int(k.max())
        idx = best_end[:, None] + 1 + np.arange(k_max)[None, :]
        valid = (idx < lens[:, None]) & (np.arange(k_max)[None, :] < k[:, None]) & (best_n > 0)[:, None]
        drafts = tokens[batch[:, None], np.minimum(idx, width - 1)]
        counts = valid.sum(axis=1).tolist()
        return [d[:c] for d, c in zip(drafts.tolist(), counts)]

    def on_finished(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._lens[row] = 0
            self._free.append(row)
