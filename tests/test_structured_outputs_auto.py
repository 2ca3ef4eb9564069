"""backend="auto" (the default) picks per request, as vLLM: xgrammar when it supports the constraint, else
guidance (llguidance); one batch may hold both, each backend filling its own bitmask rows."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.structured_output import StructuredOutputError
from pagoda.structured_output.auto import AutoBackend

pytest.importorskip("pagoda_structured_xgrammar")
pytest.importorskip("pagoda_structured_llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
# Lark that only llguidance takes: a Lark grammar is converted to EBNF for xgrammar (as vLLM), but a regex flag
# (/i, the same language here: digits have no case) has no EBNF form
LARK = r"""
start: expr
expr: NUMBER (("+" | "*") NUMBER)*
NUMBER: /[1-9][0-9]?/i
"""


def test_select_prefers_xgrammar_and_falls_back_to_guidance() -> None:
    assert AutoBackend.select(StructuredOutputsParams(json=SCHEMA)) == "xgrammar"
    assert AutoBackend.select(StructuredOutputsParams(grammar='root ::= "a" | "b"')) == "xgrammar"
    # a schema xgrammar cannot compile (minProperties beyond the declared properties) but llguidance can
    assert AutoBackend.select(StructuredOutputsParams(json={"type": "object", "minProperties": 2})) == "guidance"
    # plain Lark reaches xgrammar as EBNF
    assert AutoBackend.select(StructuredOutputsParams(grammar='?start: "yes" | "no"')) == "xgrammar"
    lark = StructuredOutputsParams(grammar=LARK)
    assert AutoBackend.select(lark) == "guidance"
    assert lark._backend == "guidance"  # recorded for the engine, as vLLM's _backend
    with pytest.raises(StructuredOutputError, match="xgrammar: invalid structured_outputs.regex.*guidance:"):
        AutoBackend.select(StructuredOutputsParams(regex="a(b"))


def test_one_batch_with_both_backends() -> None:
    llm = LLM(max_num_seqs=8)
    json_params = SamplingParams(temperature=0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    lark_params = SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(grammar=LARK))
    regex_params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    outs = llm.generate(["A person as JSON:", "Some arithmetic:", "A year:"], [json_params, lark_params, regex_params])
    first, second, third = (o.outputs[0] for o in outs)
    assert first.finish_reason == "stop", first.text
    jsonschema.validate(json.loads(first.text), SCHEMA)
    # sampled at temperature 1 the model may keep adding terms until max_tokens: then the text is a prefix of the
    # language (at most a trailing operator); once stopped it is a whole expression
    expression = r"[1-9][0-9]?([+*][1-9][0-9]?)*" + ("" if second.finish_reason == "stop" else "[+*]?")
    assert second.finish_reason in ("stop", "length") and re.fullmatch(expression, second.text), second.text
    assert re.fullmatch("[0-9]{4}", third.text), third.text
    manager = llm.llm_engine.engine_core.core.scheduler.structured_output_manager
    assert sorted(manager.backend._backends) == ["guidance", "xgrammar"]  # both compiled here
