"""Structured outputs with speculative decoding on the default model: drafts are trimmed to what the grammar
allows, each verified position gets its own bitmask row, rejected drafts roll the matcher back. Outputs stay
valid, greedy ones equal those without speculation, and constrained requests really accept drafts."""

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
    # float32: in bfloat16 the model has exact ties (a verify step's and a decode step's kernels break them
    # differently), which would make the greedy comparison about rounding, not speculation
    spec = LLM(max_num_seqs=16, speculative_config=SPEC, structured_outputs_config=so_config, dtype="float32")
    plain = LLM(max_num_seqs=16, structured_outputs_config=so_config, dtype="float32")
    prompts = ["List six fruits with counts as JSON:", "Three phone numbers:"]
    params = [SamplingParams(temperature=0, max_tokens=150,
                             structured_outputs=StructuredOutputsParams(json=ROWS, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=PHONE))]
    got = [o.outputs[0] for o in spec.generate(prompts, params)]
    want = [o.outputs[0] for o in plain.generate(prompts, params)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
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
    # a few of the shared schemas (all of them take minutes on two CPU cores)
    sc.check_json_schemas_validate(spec, SCHEMAS[:4])
