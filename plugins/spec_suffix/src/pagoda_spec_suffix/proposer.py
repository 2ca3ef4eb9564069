"""Suffix decoding (vLLM's ``method: suffix``, after Arctic Inference's): match the longest recent suffix of
a request's tokens in suffix tries and draft the likeliest continuation.

Two tries: the request's own (its prompt and outputs, grown token by token) and a global one over the
outputs of up to ``suffix_decoding_max_cached_requests`` finished requests (oldest forgotten first). Each
proposes its likeliest path below the longest matched suffix, at most ``suffix_decoding_max_spec_factor``
tokens per matched token and never past a token whose estimated probability (the path's share of the
occurrences) is below ``suffix_decoding_min_token_prob``; the draft with the higher score (the sum of its
tokens' probabilities) wins.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.spec_decode import DraftRequest, Proposer, SpeculativeConfig
from pagoda_spec_suffix.tree import SuffixCursor, SuffixTrie


@dataclass
class _RequestState:
    trie: SuffixTrie
    cursor: SuffixCursor
    num_prompt_tokens: int
    # the request's live token list (read at its end for the global trie)
    tokens: Sequence[int] = field(default_factory=list)
    seen: int = 0  # tokens added to the trie so far


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.global_trie = SuffixTrie(self.depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        self._requests: dict[str, _RequestState] = {}

    def _state(self, r: DraftRequest) -> _RequestState:
        state = self._requests.get(r.req_id)
        if state is None:
            trie = SuffixTrie(self.depth)
            state = self._requests[r.req_id] = _RequestState(trie, SuffixCursor(trie), r.num_prompt_tokens)
        tokens = r.token_ids
        for t in tokens[state.seen:]:
            state.cursor.append(t)
        state.tokens = tokens
        state.seen = len(tokens)
        return state

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            self._state(r)
            best: tuple[list[int], float] = ([], 0.0)
            tries = [self._requests[r.req_id].trie] + ([self.global_trie] if self._cached else [])
            for trie in tries:
                node, length = trie.match(r.token_ids)
                if node is None:
                    continue
                limit = min(r.max_num_tokens, math.ceil(self.spec_factor * length))
                draft = SuffixTrie.continue_from(node, limit, self.min_prob)
                if draft[1] > best[1]:
                    best = draft
            out.append(best[0])
        return out

    def on_finished(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        output = list(state.tokens[state.num_prompt_tokens:]) if state is not None else []
        if self.max_cached == 0 or not output:
            return
        self._cached[req_id] = output
        self.global_trie.add_sequence(output)
        while len(self._cached) > self.max_cached:
            _, old = self._cached.popitem(last=False)
            self.global_trie.add_sequence(old, sign=-1)
