"""A depth-bounded suffix trie with occurrence counts: every substring of at most ``depth`` tokens of what
was added is a path from the root, and each node counts how often its path occurred.

Appending one token extends the ``depth`` open suffixes that end at the previous token (O(depth) per
token), so a request's trie grows with its tokens and never rescans them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()

    def add_sequence(self, tokens: Iterable[int], sign: int = 1) -> None:
        """Count (``sign=1``) or uncount (``-1``) every substring of at most ``depth`` tokens of ``tokens``."""
        cursor = SuffixCursor(self)
        for t in tokens:
            cursor.append(t, sign)

    def match(self, context: Sequence[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``depth`` tokens) that some earlier
        occurrence continues, and that suffix's length; (None, 0) when none does."""
        for length in range(min(self.depth, len(context)), 0, -1):
            node: Node | None = self.root
            for t in context[len(context) - length:]:
                node = node.children.get(t) if node is not None else None
                if node is None:
                    break
            if node is not None and any(c.count > 0 for c in node.children.values()):
                return node, length
        return None, 0

    @staticmethod
    def continue_from(node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The likeliest path below ``node``: -> (its tokens, the sum of their estimated probabilities).
        Stops at ``max_tokens`` or where the path's estimated probability falls below ``min_prob``."""
        out: list[int] = []
        prob = 1.0
        score = 0.0
        while len(out) < max_tokens:
            live = [(c.count, t, c) for t, c in node.children.items() if c.count > 0]
            if not live:
                break
            total = sum(n for n, _, _ in live)
            count, token, child = max(live, key=lambda x: (x[0], -x[1]))
            prob *= count / total
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score


class SuffixCursor:
    """The open suffixes of a sequence being added to a trie (its last ``depth - 1`` tokens' paths)."""

    __slots__ = ("trie", "open")

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.open: list[Node] = []

    def append(self, token: int, sign: int = 1) -> None:
        extended = []
        for node in [self.trie.root, *self.open]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += sign
            extended.append(child)
        # paths of ``depth`` tokens are complete: they are not extended further
        self.open = extended[: self.trie.depth - 1]
