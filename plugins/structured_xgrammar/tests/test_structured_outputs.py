"""Structured outputs end to end with the default model (SmolLM2 GGUF) and the xgrammar backend."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagoda import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagoda.structured_output import StructuredOutputError, apply_token_bitmask
from pagoda.testing import structured_checks as sc
from pagoda.testing.json_schemas import SCHEMAS

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]?
"""
ARITHMETIC_RE = re.compile(r"^[0-9+\-*/()]+$")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64)


def test_json_schemas_validate_at_temperature_0_and_1(llm: LLM) -> None:
    sc.check_json_schemas_validate(llm)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC)),
        # the older name maps onto structured_outputs
        SamplingParams(temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
    ]
    prompts = ["A phone number:", "Another phone number:", "I love this film. Sentiment:", "Meh. Sentiment:",
               "Write an arithmetic expression:", "Is water wet?"]
    texts = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1]), texts
    assert texts[2] in choices and texts[3] in choices, texts
    assert ARITHMETIC_RE.match(texts[4]), texts[4]
    assert eval(texts[4], {"__builtins__": {}}) is not None  # noqa: S307 - the grammar allows digits and operators only
    assert texts[5] in ("yes", "no")


def test_json_object_and_n_greater_than_1(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True))
    obj = SamplingParams(temperature=0, max_tokens=200,
                         structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    # greedy on the default (Q4_1 kept in blocks) model: this prompt ends its object; "Repeat this JSON object"
    # made it list keys until max_tokens, which says nothing about the constraint
    many, single = llm.generate(["A person in JSON:", 'Return this JSON: {"a": 1}'],
                                [params, obj])
    assert len(many.outputs) == 4
    for completion in many.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])
    assert single.outputs[0].finish_reason == "stop", single.outputs[0].text
    assert isinstance(json.loads(single.outputs[0].text), dict)


def test_stop_string_ends_a_constrained_request(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=60, stop=['"age"'],
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    completion = llm.generate(["A person in JSON:"], params)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == '"age"'
    assert '"age"' not in completion.text and completion.text.startswith("{")


def test_bad_constraints_are_value_errors(llm: LLM) -> None:
    cases = [StructuredOutputsParams(json={"type": "nope"}), StructuredOutputsParams(regex="a(b"),
             StructuredOutputsParams(grammar="root ::= (")]
    for constraint in cases:
        with pytest.raises(StructuredOutputError, match="invalid structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs=constraint))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_preemption_keeps_outputs_valid() -> None:
    sc.check_preemption_keeps_outputs_valid()


def test_apply_token_bitmask_matches_a_reference() -> None:
    vocab = 70
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    allowed = torch.rand(2, vocab, generator=gen) > 0.5
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    expected = logits.clone()
    for i, row in enumerate((1, 3)):
        expected[row, ~allowed[i]] = float("-inf")
    apply_token_bitmask(logits, torch.tensor([1, 3]), bitmask)
    assert torch.equal(logits, expected)


def test_xgrammar_bit_layout_matches_core_masking() -> None:
    import xgrammar as xgr

    sc.check_bit_layout_matches_core_masking(xgr.apply_token_bitmask_inplace)
