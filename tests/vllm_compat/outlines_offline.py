"""Outlines' vLLM offline integration on ``vllm.LLM`` = pagoda's LLM (run by tests/test_vllm_compat.py).

Run in a child process with pagoda-vllm-compat's ``vllm`` importable; prints one JSON object with
what each kind of constraint produced, for the test to check.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Literal

import outlines
from outlines.types import CFG, Choice, Regex
from pydantic import BaseModel, Field

import vllm


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Colour(str, Enum):
    red = "red"
    green = "green"


ARITHMETIC = '?start: expr\n?expr: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9]/\n'
# Outlines' users write single quotes
YES_NO = "start: answer\nanswer: 'yes'\n      | 'no'"


def main() -> None:
    llm = vllm.LLM(max_model_len=512, max_num_seqs=4, num_kv_blocks=64)
    model = outlines.from_vllm_offline(llm)
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=60)
    results = {
        "model_class": type(model).__name__,
        "pydantic": model("Give me a person as JSON.", Person, sampling_params=greedy),
        "regex": model("A year:", Regex(r"(19|20)[0-9]{2}"), sampling_params=greedy),
        "literal": model("Is the sky blue? Answer yes or no.", Literal["yes", "no"], sampling_params=greedy),
        "choice": model("Pick a colour.", Choice(["red", "green", "blue"]), sampling_params=greedy),
        "enum": model("Pick a colour.", Colour, sampling_params=greedy),
        "cfg": model("1+2=", CFG(ARITHMETIC), sampling_params=vllm.SamplingParams(temperature=0.0, max_tokens=8)),
        "cfg_yes_no": model("Is it?", CFG(YES_NO), sampling_params=vllm.SamplingParams(temperature=0.0, max_tokens=5)),
        "batch": model.batch(
            ["A year:", "Another year:", "The year the war ended:"], Regex(r"(19|20)[0-9]{2}"),
            sampling_params=greedy,
        ),
        # n=3 random samples in one call: Outlines returns a list
        "samples": model("A digit:", Regex(r"[0-9]"), sampling_params=vllm.SamplingParams(n=3, seed=7, max_tokens=2)),
        "unconstrained": model("Say hi.", sampling_params=vllm.SamplingParams(temperature=0.0, max_tokens=5)),
    }
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
