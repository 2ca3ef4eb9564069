"""Benchmark workloads: random token-id prompts, or ShareGPT-style JSON files."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """Fixed-seed random prompts; ``prefix_len`` tokens shared by every prompt (prefix-cache workloads).

    Ids are drawn away from the lowest ids, where tokenizers keep special tokens.
    """
    if num_prompts <= 0 or input_len <= 0 or output_len <= 0:
        raise ValueError("num_prompts, input_len and output_len must be positive")
    rng = random.Random(seed)
    low = min(1000, vocab_size // 4)
    shared = [rng.randrange(low, vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(shared + [rng.randrange(low, vocab_size) for _ in range(input_len)], output_len)
        for _ in range(num_prompts)
    ]


def sharegpt_requests(path: str | Path, num_prompts: int, tokenizer: Any, seed: int = 0,
                      output_len: int | None = None, max_len: int = 2048) -> list[BenchRequest]:
    """First human turn as the prompt, the first reply's length as the output length."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    rng.shuffle(data)
    out: list[BenchRequest] = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt_ids = tokenizer(turns[0].get("value", "")).input_ids
        reply_len = output_len or len(tokenizer(turns[1].get("value", "")).input_ids)
        if len(prompt_ids) < 4 or reply_len < 4 or len(prompt_ids) + reply_len > max_len:
            continue
        out.append(BenchRequest(prompt_ids, reply_len))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations")
    return out
