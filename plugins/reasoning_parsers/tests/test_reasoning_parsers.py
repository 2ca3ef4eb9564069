"""deepseek_r1 and qwen3 on a real tokenizer (the default model's, with <think> and </think> added as tokens)."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.model_loader import resolve_model_path
from pagoda.model_loader.tokenizer import load_tokenizer
from pagoda.reasoning import ReasoningParser, ReasoningParserError, get_reasoning_parser


def _load(special: bool) -> Any:
    tok = load_tokenizer(resolve_model_path(None))
    # as in Qwen3's and DeepSeek-R1's tokenizers the tags are added tokens that are not special (they stay in the
    # decoded text); the special variant drops them from the text, so the streaming split goes by token ids
    tok.add_tokens(["<think>", "</think>"], special_tokens=special)
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _load(special=False)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def _parser(name: str, tok: Any, prompt: str = "") -> ReasoningParser:
    return get_reasoning_parser(name)(tok, prompt_token_ids=_ids(tok, prompt) if prompt else None)


def _stream(parser: ReasoningParser, tok: Any, ids: list[int], step: int = 1) -> tuple[str, str]:
    """Feed ``ids`` ``step`` tokens at a time as a detokenizer would; the reasoning and content streamed."""
    reasoning, content = "", ""
    previous_text, previous_ids = "", []
    for i in range(0, len(ids), step):
        delta_ids = ids[i:i + step]
        current_ids = previous_ids + delta_ids
        current_text = tok.decode(current_ids, skip_special_tokens=True)
        delta = parser.extract_reasoning_content_streaming(previous_text, current_text,
                                                           current_text[len(previous_text):], previous_ids,
                                                           current_ids, delta_ids)
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
        previous_text, previous_ids = current_text, current_ids
    return reasoning, content




CASES = [
    # (parser, prompt, output, expected (reasoning, content))
    ("deepseek_r1", "", "<think>Two plus two is four.</think>The answer is 4.",
     ("Two plus two is four.", "The answer is 4.")),
    ("deepseek_r1", "", "Two plus two is four.</think>The answer is 4.", ("Two plus two is four.", "The answer is 4.")),
    ("deepseek_r1", "", "Still thinking about it", ("Still thinking about it", None)),
    ("qwen3", "", "<think>Two plus two is four.</think>The answer is 4.",
     ("Two plus two is four.", "The answer is 4.")),
    ("qwen3", "", "The answer is 4.", (None, "The answer is 4.")),
    ("qwen3", "", "no start tag</think>The answer is 4.", (None, "no start tag</think>The answer is 4.")),
    ("qwen3", "User: add\nAssistant: <think>", "Two plus two.</think>The answer is 4.",
     ("Two plus two.", "The answer is 4.")),
    ("qwen3", "User: add\nAssistant: <think>\n\n</think>\n\n", "The answer is 4.", (None, "The answer is 4.")),
]


@pytest.mark.parametrize("name,prompt,output,expected", CASES)
def test_whole_output_and_stream_agree(tokenizer: Any, name: str, prompt: str, output: str,
                                       expected: tuple[str | None, str | None]) -> None:
    ids = _ids(tokenizer, output)
    assert _parser(name, tokenizer, prompt).extract_reasoning_content(tokenizer.decode(ids), None) == expected
    for step in (1, 3):
        streamed = _stream(_parser(name, tokenizer, prompt), tokenizer, ids, step)
        assert streamed == (expected[0] or "", expected[1] or ""), (step, streamed)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_stream_splits_by_token_ids_when_the_tags_are_special(name: str) -> None:
    tok = _load(special=True)
    ids = _ids(tok, "<think>Two plus two is four.</think>The answer is 4.")
    for step in (1, 4, len(ids)):
        assert _stream(_parser(name, tok), tok, ids, step) == ("Two plus two is four.", "The answer is 4."), step


def test_reasoning_end_and_content_ids(tokenizer: Any) -> None:
    parser = _parser("deepseek_r1", tokenizer)
    think = _ids(tokenizer, "<think>")[0]
    end = _ids(tokenizer, "</think>")[0]
    answer = _ids(tokenizer, "The answer")
    assert not parser.is_reasoning_end([think, 5, 6])
    assert parser.is_reasoning_end([think, 5, end, *answer])
    # a later <think> opens a new reasoning (a multi-turn prompt)
    assert not parser.is_reasoning_end([think, end, 7, think, 8])
    assert parser.is_reasoning_end_streaming([think, 5, end], [end])
    assert not parser.is_reasoning_end_streaming([think, 5, 6], [6])
    assert parser.extract_content_ids([think, 5, end, *answer]) == answer
    assert parser.extract_content_ids([think, 5, end]) == []


def test_a_tokenizer_without_the_tags_is_refused() -> None:
    tok = load_tokenizer(resolve_model_path(None))
    with pytest.raises(ReasoningParserError, match="<think>"):
        get_reasoning_parser("qwen3")(tok)


def test_unknown_parser_names_the_registered_ones() -> None:
    with pytest.raises(ReasoningParserError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")
