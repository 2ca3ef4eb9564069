"""Prefix-cache keys of full KV blocks.

A block's key (``BlockHash``) is a 32-byte SHA-256 digest of
``(parent key, the block's token ids, extra keys)``. Chaining the parent key in
makes a key stand for the whole prefix up to and including its block, so a
lookup that walks a request's keys in order and stops at the first miss finds
exactly the longest cached prefix.

Why SHA-256 and not Python's ``hash()`` of a tuple: a server shares its cache
between tenants, and a 64-bit non-cryptographic hash lets anyone who can send
prompts craft a collision and read attention state computed from someone
else's tokens. SHA-256 makes that infeasible, and costs about a microsecond
per block (tokens are packed by ``array`` in C, no per-token Python), paid once
per block as it fills. Digests are also stable across processes and runs, which
``hash()`` of strings (cache salts) is not.

Extra keys (a cache salt, a LoRA id, ...) are mixed into every block's key:
two requests that differ in them never share a block.

Only *full* blocks get a key: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block and its whole prefix."""

# The parent of a request's first block. Versioned so a change of the encoding
# below can never match keys made by the old one.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagoda-prefix-cache-v1").digest()

_TOKEN_TYPECODE = "q"  # int64: any vocabulary id fits, the packing is done in C
_LENGTH = struct.Struct("<Q")


def _encode_extra_key(key: Any, out: bytearray) -> None:
    """Append a typed, length-prefixed encoding of ``key`` (no two keys encode alike)."""
    if key is None:
        out += b"N"
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        data = str(key).encode()
        out += b"I" + _LENGTH.pack(len(data)) + data
    elif isinstance(key, str):
        data = key.encode("utf-8")
        out += b"S" + _LENGTH.pack(len(data)) + data
    elif isinstance(key, (bytes, bytearray)):
        out += b"B" + _LENGTH.pack(len(key)) + bytes(key)
    elif isinstance(key, float):
        out += b"D" + struct.pack("<d", key)
    elif isinstance(key, tuple):
        out += b"U" + _LENGTH.pack(len(key))
        for item in key:
            _encode_extra_key(item, out)
    else:
        raise TypeError(
            f"prefix-cache extra key {key!r} has type {type(key).__name__}; "
            "use None, bool, int, float, str, bytes or a tuple of these"
        )


def encode_extra_keys(extra_keys: tuple[Any, ...] | None) -> bytes:
    """The bytes mixed into a block key for ``extra_keys`` (empty for none)."""
    if not extra_keys:
        return b""
    out = bytearray()
    _encode_extra_key(tuple(extra_keys), out)
    return bytes(out)


def _hash_block(parent: BlockHash, tokens: bytes, num_tokens: int, extra: bytes) -> BlockHash:
    hasher = hashlib.sha256(parent)
    hasher.update(_LENGTH.pack(num_tokens))
    hasher.update(tokens)
    hasher.update(extra)
    return hasher.digest()


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return array(_TOKEN_TYPECODE, token_ids).tobytes()
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be integers in int64 range: {exc}") from exc


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The key of one block holding ``token_ids`` after the block keyed ``parent``.

    ``parent`` None means the block is the first of its sequence.
    """
    parent_hash = ROOT_BLOCK_HASH if parent is None else parent
    return _hash_block(parent_hash, _pack_tokens(token_ids), len(token_ids), encode_extra_keys(extra_keys))


MultiModalSpan = tuple[str, int, int]
"""(an item's content hash, its placeholders' offset, their count): ``MultiModalInputs.spans()``."""


def _mm_block_extra(extra_keys: tuple[Any, ...] | None, spans: Sequence[MultiModalSpan], start: int,
                    end: int) -> bytes:
    """A block's extra keys with the hashes of the items whose placeholders it covers: two images behind the
    same placeholder tokens never share a block, and the chain carries the difference to every later one."""
    items = tuple(("mm", ident, max(start, offset) - offset) for ident, offset, length in spans
                  if offset < end and offset + length > start)
    if not items:
        return encode_extra_keys(extra_keys)
    return encode_extra_keys((*(extra_keys or ()), *items))


def hash_request_blocks(
    prev_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> list[BlockHash]:
    """Extend ``prev_hashes`` in place with the keys of the full blocks not yet hashed.

    ``prev_hashes`` holds the keys of the first ``len(prev_hashes)`` blocks of
    ``token_ids``; each newly full block is hashed exactly once. Returns
    ``prev_hashes`` (the same list) for convenience. ``mm_spans``: the request's
    multimodal items, mixed into the keys of the blocks they cover.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    start_block = len(prev_hashes)
    if start_block > num_full_blocks:
        raise ValueError(
            f"{start_block} block hashes given but token_ids ({len(token_ids)} tokens) "
            f"holds only {num_full_blocks} full blocks of {block_size}"
        )
    if start_block == num_full_blocks:
        return prev_hashes
    # One C-level conversion for all new blocks; each block is a bytes slice.
    packed = _pack_tokens(token_ids[start_block * block_size : num_full_blocks * block_size])
    bytes_per_block = block_size * array(_TOKEN_TYPECODE).itemsize
    extra = encode_extra_keys(extra_keys)
    parent = prev_hashes[-1] if prev_hashes else ROOT_BLOCK_HASH
    for i in range(num_full_blocks - start_block):
        if mm_spans:
            first = (start_block + i) * block_size
            extra = _mm_block_extra(extra_keys, mm_spans, first, first + block_size)
        parent = _hash_block(parent, packed[i * bytes_per_block : (i + 1) * bytes_per_block], block_size, extra)
        prev_hashes.append(parent)
    return prev_hashes


class _CacheKeyed(Protocol):
    """What a request carries that keys its blocks beside their tokens (``pagoda.scheduler.request.Request``)."""

    cache_salt: str | None
    lora_request: LoRARequest | None


def extra_keys(cache_salt: str | None, lora_request: LoRARequest | None) -> tuple[Any, ...] | None:
    """The extra keys of a request with this salt and adapter: blocks computed under another adapter
    (or the base model) hold other K/V and never match."""
    keys: list[Any] = []
    if cache_salt:
        keys.append(("salt", cache_salt))
    if lora_request is not None:
        keys.append(("lora", lora_request.lora_int_id, lora_request.lora_name))
    return tuple(keys) if keys else None


def request_extra_keys(request: _CacheKeyed) -> tuple[Any, ...] | None:
    """Extra keys of a request from its ``cache_salt`` and its ``lora_request`` record."""
    return extra_keys(request.cache_salt, request.lora_request)
