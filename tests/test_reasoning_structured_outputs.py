"""With a reasoning parser, structured outputs constrain only the answer: the grammar waits for the reasoning's end.

The default model (SmolLM2) has no <think> tokens, so a parser registered in-process here ends the reasoning at a
token the model is known to write greedily; until then the output must equal the unconstrained one, after it the
regex holds (and without the parser the very first token would already be a digit).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.plugins import ReasoningParserSpec, get_plugin_manager, hookimpl, reset_plugin_manager
from pagoda.reasoning import ReasoningParser

PROMPT = "The capital of France is"
DIGITS = "[0-9]{4}"


class EndAtToken(ReasoningParser):
    """Reasoning ends at ``END_ID`` (set by the test once it knows the model's greedy tokens)."""

    END_ID = -1

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return self.END_ID in input_ids

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Any) -> bool:
        return self.END_ID in list(delta_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        return input_ids[input_ids.index(self.END_ID) + 1:] if self.END_ID in input_ids else []

    def extract_reasoning_content(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        raise NotImplementedError("the engine never splits text")

    def extract_reasoning_content_streaming(self, *args: Any) -> Any:
        raise NotImplementedError("the engine never splits text")


class _Plugin:
    PAGODA_PLUGIN_API_VERSION = "1.4"

    @hookimpl
    def pagoda_register_reasoning_parsers(self) -> list[ReasoningParserSpec]:
        return [ReasoningParserSpec("end_at_token", f"{__name__}:EndAtToken")]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    get_plugin_manager().register(_Plugin(), name="end-at-token", kind="reasoning_parser")
    yield LLM(reasoning_parser="end_at_token", max_num_seqs=4)
    reset_plugin_manager()


def test_grammar_applies_after_the_reasoning_ends(llm: LLM) -> None:
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    tokens = list(free.token_ids)
    assert not re.match("[0-9]", free.text), free.text  # else the test could not tell gated from not
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in prompt_ids)
    EndAtToken.END_ID = tokens[k]
    digits = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=DIGITS))
    reasoning, closed = llm.generate([PROMPT, {"prompt_token_ids": prompt_ids + [tokens[k]]}], [digits, digits])
    out = reasoning.outputs[0]
    # free until (and with) the end token, then exactly the regex
    assert list(out.token_ids[:k + 1]) == tokens[:k + 1], (out.text, free.text)
    answer = llm.get_tokenizer().decode(out.token_ids[k + 1:], skip_special_tokens=True)
    assert re.fullmatch(DIGITS, answer), (out.text, answer)
    assert out.finish_reason == "stop"
    # a prompt that already ended the reasoning (a template that closed it): constrained from the first token
    assert re.fullmatch(DIGITS, closed.outputs[0].text), closed.outputs[0].text


def test_enable_in_reasoning_constrains_from_the_start(llm: LLM) -> None:
    # (the fixture registered the parser)
    eager = LLM(reasoning_parser="end_at_token", max_num_seqs=2, structured_outputs_config={"enable_in_reasoning": True})
    EndAtToken.END_ID = 10**9  # never: without enable_in_reasoning nothing would be constrained
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=DIGITS))
    assert re.fullmatch(DIGITS, eager.generate(PROMPT, params)[0].outputs[0].text)
    assert not re.fullmatch(DIGITS, llm.generate(PROMPT, params)[0].outputs[0].text)


def test_unknown_reasoning_parser_fails_the_engine_start() -> None:
    with pytest.raises(ValueError, match="reasoning parser 'nope' is not registered"):
        LLM(reasoning_parser="nope", max_num_seqs=2)
