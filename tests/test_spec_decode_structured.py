"""Structured outputs with speculative decoding on the default model: drafts are trimmed to what the grammar
allows, each verified position gets its own bitmask row, rejected drafts roll the matcher back. Outputs stay
valid and constrained requests really accept drafts.

Greedy equality with and without speculation is tested on float models (tests/test_spec_decode.py): the
default model is a GGUF checkpoint whose quantized matmul rounds a one-row decode and a several-row step
differently (logprobs 0.03 apart at the same position without any speculation, measured), so a verify step
can break a near-tie the other way."""

from __future__ import annotations

import json
import re

import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.testing import structured_checks as sc
from pagoda.testing.json_schemas import SCHEMAS

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# a repetitive structure: the n-gram proposer drafts the keys and separators it has seen
ROWS = {"type": "array", "minItems": 6, "maxItems": 6,
        "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "count": {"type": "integer"}},
                  "required": ["name", "count"], "additionalProperties": False}}
PHONE = r"\((555)\) [0-9]{3}-[0-9]{4}, \((555)\) [0-9]{3}-[0-9]{4}, \((555)\) [0-9]{3}-[0-9]{4}"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_outputs_stay_valid_with_speculation(backend: str) -> None:
    so_config = {"backend": backend}
    spec = LLM(max_num_seqs=16, speculative_config=SPEC, structured_outputs_config=so_config)
    prompts = ["List six fruits with counts as JSON:", "Three phone numbers:"]
    params = [SamplingParams(temperature=0, max_tokens=150,
                             structured_outputs=StructuredOutputsParams(json=ROWS, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=PHONE))]
    got = [o.outputs[0] for o in spec.generate(prompts, params)]
    assert len(json.loads(got[0].text)) == 6
    assert re.fullmatch(PHONE, got[1].text), got[1].text
    stats = spec.llm_engine.engine_core.core.make_stats().spec_decoding_stats
    assert stats is not None and stats.num_accepted_tokens > 0, "constrained requests were meant to accept drafts"
    # sampled ones too, and the shared schema checks
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=150,
                              structured_outputs=StructuredOutputsParams(json=ROWS, disable_any_whitespace=True))
               for s in range(4)]
    for out in spec.generate([prompts[0]] * 4, sampled):
        assert len(json.loads(out.outputs[0].text)) == 6
    if backend == "xgrammar":
        # a few of the shared schemas (all of them take minutes on two CPU cores); with guidance the model's
        # greedy answer to the "score" schema runs into 1.0000... until max_tokens without speculation too
        sc.check_json_schemas_validate(spec, SCHEMAS[:4])
