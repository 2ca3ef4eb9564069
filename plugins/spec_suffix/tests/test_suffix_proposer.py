"""The suffix trie and proposer: exact counts, the longest continued suffix, the likeliest path, the
global trie over finished requests' outputs (and its eviction)."""

from __future__ import annotations

from pagoda.spec_decode import DraftRequest, SpeculativeConfig
from pagoda_spec_suffix.proposer import SuffixProposer
from pagoda_spec_suffix.tree import SuffixTrie


def _count(trie: SuffixTrie, path: list[int]) -> int:
    node = trie.root
    for t in path:
        if t not in node.children:
            return 0
        node = node.children[t]
    return node.count


def test_trie_counts_every_short_substring() -> None:
    trie = SuffixTrie(depth=3)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    trie.add_sequence(tokens)
    for n in range(1, 4):
        for i in range(len(tokens) - n + 1):
            path = tokens[i:i + n]
            expected = sum(tokens[j:j + n] == path for j in range(len(tokens) - n + 1))
            assert _count(trie, path) == expected, path
    assert _count(trie, [1, 2, 3, 1]) == 0  # deeper than the trie
    trie.add_sequence(tokens, sign=-1)
    assert _count(trie, [1, 2]) == 0


def test_match_and_likeliest_continuation() -> None:
    trie = SuffixTrie(depth=4)
    trie.add_sequence([7, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 5])
    node, length = trie.match([4, 4, 1, 2])
    assert length == 2
    # after "1 2": 3 twice, 5 once -> 3 (p = 2/3), then 9 (p = 2/3 * 1); then the trie's depth (matched
    # suffix + draft <= 4) ends the path
    draft, score = SuffixTrie.continue_from(node, 3, min_prob=0.5)
    assert draft == [3, 9]
    assert abs(score - 2 * 2 / 3) < 1e-9
    assert SuffixTrie.continue_from(node, 3, min_prob=0.7)[0] == []


def _proposer(**kw) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", **kw))


def test_proposer_drafts_from_the_request_then_from_earlier_outputs() -> None:
    p = _proposer(num_speculative_tokens=4, suffix_decoding_max_cached_requests=1)
    tokens = [5, 6, 7, 8, 9, 5, 6]
    assert p.propose([DraftRequest("a", tokens, 3, 4)]) == [[7, 8]]  # 2 matched tokens: spec factor 1 caps at 2
    tokens += [7, 8]
    assert p.propose([DraftRequest("a", tokens, 3, 4)]) == [[9, 5, 6, 7]]
    p.on_finished("a")
    # a new request whose context ends like a's output did
    assert p.propose([DraftRequest("b", [1, 8, 9, 5], 4, 4)]) == [[6, 7, 8]]
    p.on_finished("b")  # b had no output: nothing cached, a's stays
    p.propose([DraftRequest("c", [0, 0, 42, 43], 2, 2)])
    p.on_finished("c")  # evicts a's output (one cached request at most)
    assert p.propose([DraftRequest("d", [1, 8, 9, 5], 4, 4)]) == [[]]
