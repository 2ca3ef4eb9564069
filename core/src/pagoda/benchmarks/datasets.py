"""Benchmark workloads: random token-id prompts, input-grounded text prompts made here, or ShareGPT-style JSON files."""

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


# The input-grounded workload: the answer copies, condenses or edits a passage given in the prompt, the case
# where n-gram, suffix and predicted-output drafts pay. Passages are made here from fixed word lists (no
# hub dataset): fluent enough for a model to copy, different per prompt.
_SUBJECTS = ("the engineer", "a small team", "the committee", "the old harbour crew", "our neighbour", "the city",
             "the research group", "a young teacher", "the night shift", "the farmer")
_VERBS = ("repaired", "measured", "painted", "inspected", "moved", "rebuilt", "cleaned", "recorded", "tested",
          "replaced")
_OBJECTS = ("the north bridge", "three wooden boats", "the water pumps", "the school roof", "every street lamp",
            "the long fence", "the clock tower", "two greenhouses", "the railway signals", "the library shelves")
_WHEN = ("before the winter storms", "on a quiet Sunday", "after the spring floods", "during the long summer",
         "early in the morning", "within a single week", "despite the heavy rain", "late in the autumn")
_WHY = ("so that the market could open again", "because the old parts had worn out", "to keep the children safe",
        "as the mayor had promised", "to save money next year", "after many complaints", "for the coming festival")
_TASKS = (
    "Repeat the following passage exactly, word for word.\n\n{p}\n\nRepeated passage:\n",
    "Summarise the following passage in a few sentences, reusing its wording.\n\n{p}\n\nSummary:\n",
    "Rewrite the following passage with every occurrence of \"{a}\" replaced by \"{b}\", changing nothing "
    "else.\n\n{p}\n\nEdited passage:\n",
)


def grounded_passage(rng: random.Random, num_tokens: int, tokenizer: Any) -> str:
    """Sentences from the word lists until the passage is ``num_tokens`` tokens long (or just over)."""
    sentences: list[str] = []
    while True:
        sentences.append(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                         f"{rng.choice(_WHEN)}, {rng.choice(_WHY)}.")
        text = " ".join(sentences)
        if len(tokenizer(text, add_special_tokens=False).input_ids) >= num_tokens:
            return text


def grounded_requests(num_prompts: int, passage_len: int, output_len: int, tokenizer: Any,
                      seed: int = 0) -> list[BenchRequest]:
    """Prompts asking to repeat, summarise or edit a ``passage_len``-token passage (the tasks in turn)."""
    if num_prompts <= 0 or passage_len <= 0 or output_len <= 0:
        raise ValueError("num_prompts, input_len (the passage length) and output_len must be positive")
    if tokenizer is None:
        raise ValueError("the grounded dataset needs a tokenizer (its prompts are text)")
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        a, b = rng.sample(_OBJECTS, 2)
        task = _TASKS[i % len(_TASKS)].format(p=grounded_passage(rng, passage_len, tokenizer), a=a, b=b)
        out.append(BenchRequest(list(tokenizer(task).input_ids), output_len))
    return out
