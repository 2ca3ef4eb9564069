"""Content hashes of multimodal items.

An image's hash covers its pixels (mode, size and raw bytes after decoding, so the same picture sent as
PNG or as a data URL of the same PNG hashes alike) and the processor arguments it was processed with.
SHA-256, as the prefix cache's block keys (pagoda.kv_cache.hashing): the hash decides which KV a request
may reuse, so it must not be forgeable.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def hash_image(image: Any, processor_kwargs: dict[str, Any] | None = None) -> str:
    """Hex SHA-256 of a ``PIL.Image`` and the processor arguments."""
    hasher = hashlib.sha256(b"pagoda-mm-image-v1")
    hasher.update(image.mode.encode())
    hasher.update(repr(image.size).encode())
    hasher.update(image.tobytes())
    hasher.update(json.dumps(processor_kwargs or {}, sort_keys=True, default=repr).encode())
    return hasher.hexdigest()


def hash_prompt(prompt: str, identifiers: list[str], processor_kwargs: dict[str, Any] | None) -> str:
    """The processed-input cache's key: the prompt text, its items' hashes and the processor arguments."""
    hasher = hashlib.sha256(b"pagoda-mm-prompt-v1")
    hasher.update(json.dumps([prompt, identifiers, processor_kwargs or {}], sort_keys=True, default=repr).encode())
    return hasher.hexdigest()
