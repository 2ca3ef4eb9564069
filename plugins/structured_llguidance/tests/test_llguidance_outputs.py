"""Structured outputs end to end with the default model (SmolLM2 GGUF) and the llguidance backend ("guidance")."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.structured_output import StructuredOutputError
from pagoda.testing import structured_checks as sc
from pagoda.testing.json_schemas import SCHEMAS

# Lark, llguidance's native grammar format; one operator per level, so SmolLM2 cannot repeat "+1" until max_tokens
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)?
term: factor (("*" | "/") factor)?
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""
ARITHMETIC_RE = re.compile(r"^[0-9+\-*/()]+$")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64, structured_outputs_config={"backend": "guidance"})


def test_json_schemas_validate_at_temperature_0_and_1(llm: LLM) -> None:
    # every other one of the 50 schemas the xgrammar plugin runs (the suite's time), each at temperature 0 and 1
    sc.check_json_schemas_validate(llm, SCHEMAS[::2])


def test_regex_choice_and_lark_grammar(llm: LLM) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC)),
        SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC)),
    ]
    prompts = ["A phone number:", "Another phone number:", "I love this film. Sentiment:", "Meh. Sentiment:",
               "Write an arithmetic expression:", "Some arithmetic:"]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    texts = [o.text for o in outs]
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1]), texts
    assert texts[2] in choices and texts[3] in choices, texts
    for completion in outs[4:]:
        assert completion.finish_reason == "stop", completion.text
        assert ARITHMETIC_RE.match(completion.text), completion.text
        assert eval(completion.text, {"__builtins__": {}}) is not None  # noqa: S307 - digits and operators only


def test_structural_tag_constrains_the_tagged_part(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=weather>", "schema": schema, "end": "</function>"}]}
    # text is free until the trigger; forcing it with a prompt that starts the call keeps the test short
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag)))
    text = llm.generate(["Call the weather tool: <function=weather>"], params)[0].outputs[0].text
    match = re.search(r"<function=weather>(.*?)</function>", text, re.S)
    if match is not None:
        jsonschema.validate(json.loads(match.group(1)), schema)
    assert "<function=" not in text or match is not None, text


def test_json_object_and_n_greater_than_1(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True))
    obj = SamplingParams(temperature=0, max_tokens=200,
                         structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    many, single = llm.generate(["A person in JSON:", 'Repeat this JSON object: {"a": 1, "b": [true, null]}'],
                                [params, obj])
    assert len(many.outputs) == 4
    for completion in many.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])
    # json_object bounds nothing: SmolLM2 may repeat array items past max_tokens; what it wrote is JSON so far
    if single.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(single.outputs[0].text), dict)
    else:
        assert single.outputs[0].text.startswith("{"), single.outputs[0].text


def test_bad_constraints_are_value_errors(llm: LLM) -> None:
    cases = [StructuredOutputsParams(json={"type": "nope"}), StructuredOutputsParams(regex="a(b"),
             StructuredOutputsParams(grammar="start: undefined_rule"),
             StructuredOutputsParams(structural_tag='{"triggers": []}')]
    for constraint in cases:
        with pytest.raises(StructuredOutputError, match="invalid structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs=constraint))


def test_preemption_keeps_outputs_valid() -> None:
    sc.check_preemption_keeps_outputs_valid(backend="guidance")


def test_parallel_bitmask_fill_equals_one_by_one(llm: LLM) -> None:
    from pagoda_structured_llguidance.backend import GuidanceBackend

    backend = GuidanceBackend(llm.get_tokenizer(), 49152)
    grammars = [backend.compile(StructuredOutputsParams(json=s)) for s in SCHEMAS[:6]]
    matchers = [g.new_matcher() for g in grammars]
    for m in matchers[::2]:
        assert m.accept_tokens(llm.get_tokenizer().encode("{", add_special_tokens=False))
    parallel = backend.allocate_bitmask(len(matchers))
    backend.fill_bitmasks(matchers, list(range(len(matchers))), parallel)
    single = backend.allocate_bitmask(len(matchers))
    for row, m in enumerate(matchers):
        m.fill_bitmask(single, row)
    assert torch.equal(parallel, single)
    assert not torch.equal(parallel[0], parallel[1])  # after "{" a different set of tokens is allowed


def test_llguidance_bit_layout_matches_core_masking() -> None:
    import llguidance.torch

    sc.check_bit_layout_matches_core_masking(llguidance.torch.apply_token_bitmask_inplace)


def test_no_properties_beyond_the_schemas_unless_it_allows_them(llm: LLM) -> None:
    # as xgrammar's strict mode, so "auto" answers alike whichever backend serves a request
    from pagoda_structured_llguidance.backend import GuidanceBackend

    tokenizer = llm.get_tokenizer()
    backend = GuidanceBackend(tokenizer, 49152)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
    strict = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)).new_matcher()
    extra = tokenizer.encode('{"color":"red","x":1}', add_special_tokens=False)
    assert not strict.accept_tokens(extra)
    open_schema = {**schema, "additionalProperties": True}
    loose = backend.compile(StructuredOutputsParams(json=open_schema, disable_any_whitespace=True)).new_matcher()
    assert loose.accept_tokens(extra)
