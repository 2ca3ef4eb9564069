"""Prefix-cache keys: chaining, extra keys, incremental hashing of full blocks only."""

from __future__ import annotations

import pytest

from pagoda.kv_cache.hashing import (
    ROOT_BLOCK_HASH,
    hash_block_tokens,
    hash_request_blocks,
    request_extra_keys,
)


def test_same_tokens_same_parent_same_hash() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(hash_block_tokens(None, [1]), bytes)
    assert len(hash_block_tokens(None, [1])) == 32


def test_same_tokens_different_parent_differ() -> None:
    parent_a = hash_block_tokens(None, [1, 2])
    parent_b = hash_block_tokens(None, [1, 3])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(parent_b, [5, 6])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(None, [5, 6])


def test_token_order_and_value_matter() -> None:
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    # A large id must not alias a pair of small ones.
    assert hash_block_tokens(None, [1 << 32]) != hash_block_tokens(None, [0, 1])


def test_extra_keys_change_hash() -> None:
    plain = hash_block_tokens(None, [1, 2])
    salted = hash_block_tokens(None, [1, 2], ("salt-a",))
    assert salted != plain
    assert salted != hash_block_tokens(None, [1, 2], ("salt-b",))
    assert salted == hash_block_tokens(None, [1, 2], ("salt-a",))
    # Typed encoding: the int 1 and the string "1" are different keys.
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))
    # Empty extra keys are the same as none.
    assert hash_block_tokens(None, [1, 2], ()) == plain


def test_unsupported_extra_key_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="extra key"):
        hash_block_tokens(None, [1], (object(),))


def test_bad_token_ids_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(None, [1.5])  # type: ignore[list-item]


def test_request_hashes_match_block_by_block_chain() -> None:
    tokens = list(range(10))
    hashes = hash_request_blocks([], tokens, block_size=4)
    assert len(hashes) == 2  # the last 2 tokens are a partial block: no key
    first = hash_block_tokens(None, tokens[0:4])
    second = hash_block_tokens(first, tokens[4:8])
    assert hashes == [first, second]


def test_request_hashes_are_incremental_and_in_place() -> None:
    tokens = list(range(7))
    hashes: list[bytes] = []
    result = hash_request_blocks(hashes, tokens, block_size=4)
    assert result is hashes and len(hashes) == 1
    kept = hashes[0]
    tokens += [7, 8]  # second block fills
    hash_request_blocks(hashes, tokens, block_size=4)
    assert len(hashes) == 2 and hashes[0] is kept
    assert hashes == hash_request_blocks([], tokens, block_size=4)
    # Nothing new to hash: unchanged.
    hash_request_blocks(hashes, tokens, block_size=4)
    assert len(hashes) == 2


def test_request_hashes_only_extend_never_rehash() -> None:
    # A fake earlier key proves the old entries are taken as given, not recomputed.
    fake = b"\x01" * 32
    hashes = hash_request_blocks([fake], list(range(8)), block_size=4)
    assert hashes[0] == fake
    assert hashes[1] == hash_block_tokens(fake, [4, 5, 6, 7])


def test_request_hashes_with_extra_keys() -> None:
    tokens = list(range(8))
    assert hash_request_blocks([], tokens, 4, ("s",)) != hash_request_blocks([], tokens, 4)
    assert hash_request_blocks([], tokens, 4, ("s",))[1] == hash_block_tokens(
        hash_block_tokens(None, tokens[:4], ("s",)), tokens[4:], ("s",)
    )


def test_request_hashes_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([], [1, 2], 0)
    with pytest.raises(ValueError, match="block hashes given"):
        hash_request_blocks([ROOT_BLOCK_HASH, ROOT_BLOCK_HASH], [1, 2, 3], 2)


def test_request_extra_keys() -> None:
    from pagoda.lora.request import LoRARequest

    class Req:
        cache_salt = "abc"
        lora_request = LoRARequest("sql", 3, "/adapters/sql")

    class Plain:
        cache_salt = None
        lora_request = None

    assert request_extra_keys(Req()) == (("salt", "abc"), ("lora", 3, "sql"))
    assert request_extra_keys(Plain()) is None
