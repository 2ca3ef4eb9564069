"""LLM.chat and the shared chat rendering (pagoda.entrypoints.chat_utils)."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.chat_utils import render_chat_prompt

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def _ids(encoded: Any) -> list[int]:
    """apply_chat_template(tokenize=True) returns ids or a BatchEncoding depending on the version."""
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from pagoda.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None))


def test_render_matches_the_tokenizer_template(tokenizer: Any) -> None:
    text = render_chat_prompt(tokenizer, MESSAGES)
    assert text == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode(text, add_special_tokens=False) == _ids(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )
    no_prompt = render_chat_prompt(tokenizer, MESSAGES, add_generation_prompt=False)
    assert text.startswith(no_prompt) and len(text) > len(no_prompt)


def test_render_joins_text_parts_and_takes_a_template(tokenizer: Any) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat_prompt(tokenizer, parts) == render_chat_prompt(tokenizer, [{"role": "user", "content": "a\nb"}])
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert render_chat_prompt(tokenizer, MESSAGES, chat_template=template) == (
        "[system] You are terse.\n[user] Name a colour.\n>"
    )
    assert render_chat_prompt(tokenizer, MESSAGES, chat_template=template + "{{ flavour }}",
                              chat_template_kwargs={"flavour": "!"}).endswith(">!")


def test_render_continue_final_message(tokenizer: Any) -> None:
    messages = MESSAGES + [{"role": "assistant", "content": "The colour is"}]
    text = render_chat_prompt(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The colour is")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "image_url"),
        ({"messages": [{"content": "x"}]}, "role"),
        ({"messages": MESSAGES, "continue_final_message": True}, "cannot both"),
        ({"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}, "final assistant"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ],
)
def test_render_rejects_bad_input(tokenizer: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_chat_prompt(tokenizer, **kwargs)


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(max_model_len=512)


def test_chat_with_the_default_model_uses_the_chat_template(default_llm: LLM) -> None:
    tok = default_llm.get_tokenizer()
    out = default_llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt_token_ids == _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert out[0].prompt == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert out[0].outputs[0].text
    # a list of conversations: one output each, in order
    other = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    outs = default_llm.chat([MESSAGES, other], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert outs[1].prompt_token_ids == _ids(tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True))
