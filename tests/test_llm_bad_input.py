"""Offline bad input: refused by the Processor with a clear ValueError before it reaches the engine step."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    path, _ = tiny_model_dir("llama")  # vocabulary of 384
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64)


@pytest.mark.parametrize(("params", "needle"), [
    (SamplingParams(max_tokens=2, logit_bias={384: 1.0}), "logit_bias"),
    (SamplingParams(max_tokens=2, logit_bias={3: 1.0, 10**6: -1.0}), "logit_bias"),
    (SamplingParams(max_tokens=2, allowed_token_ids=[5, 400]), "allowed_token_ids"),
])
def test_out_of_vocabulary_ids_are_a_value_error(llm: LLM, params: SamplingParams, needle: str) -> None:
    message = rf"{needle} has token id\(s\) \[\d+\] outside the vocabulary \[0, 384\)"
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    # refused when the request is added (the Processor), not from inside an engine step
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", [1, 2, 3], params)
    assert not llm.llm_engine.has_unfinished_requests()
    # nothing reached the engine: the next request runs
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, logit_bias={7: 100.0}), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == [7, 7]


def test_multi_modal_data_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="text-only: it takes no multi_modal_data"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": object()}}],
                     SamplingParams(max_tokens=1), use_tqdm=False)


def test_tool_call_turn_renders_with_the_default_template() -> None:
    """content null + tool_calls (arguments as a JSON string), then a tool message: vLLM's normalisation."""
    from pagoda.entrypoints.chat_utils import normalize_messages, render_chat_prompt
    from pagoda.model_loader import load_tokenizer, resolve_model_path

    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    normalized = normalize_messages(messages)
    assert normalized[1]["content"] == "" and normalized[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's dict untouched
    text = render_chat_prompt(load_tokenizer(resolve_model_path(None)), messages)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n" in text
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        normalize_messages([messages[0], {**messages[1], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}])


def test_lora_request_without_enable_lora_is_refused_and_none_is_the_base_model(llm: LLM) -> None:
    from pagoda.lora.request import LoRARequest

    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("adapter", 1, "/nowhere"))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=None)
    assert len(out[0].outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("adapter", 0, "/nowhere")


def test_engine_model_config_carries_the_decided_context_length(llm: LLM, tiny_model_dir: Any) -> None:
    # vLLM's llm_engine.model_config.max_model_len is the length the engine runs with (lm-eval reads it)
    assert llm.llm_engine.model_config.max_model_len == 128
    path, _ = tiny_model_dir("llama")
    own = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=128)
    assert own.llm_engine.model_config.max_model_len == own.llm_engine.max_model_len == 1024
    assert own.llm_engine.config.model.max_model_len is None  # the config keeps what the user gave
