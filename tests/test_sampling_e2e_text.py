"""Text-level semantics (stop strings, streaming deltas) with a real tokenizer on a tiny random model.

The model has SmolLM2's vocabulary (49152) and its tokenizer, but only 2 narrow
layers, so it loads in a second and emits arbitrary multi-character tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf

    from pagoda.model_loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    cfg = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-text")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(text_model_dir: Path) -> LLM:
    return LLM(model=str(text_model_dir), dtype="float32", max_model_len=256, num_kv_blocks=256)


def _greedy(llm: LLM, max_tokens: int = 32, **kwargs: Any) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def _split_stop(llm: LLM, full: Any) -> tuple[str, int]:
    """A 4-character stop string made of the last 2 characters of one token and the first 2 of the next."""
    tok = llm.get_tokenizer()
    text = full.text
    for k in range(1, len(full.token_ids) - 1):
        before = tok.decode(full.token_ids[:k])
        after = tok.decode(full.token_ids[: k + 1])
        nxt = tok.decode(full.token_ids[: k + 2])
        b = len(after)
        if not (text.startswith(after) and nxt.startswith(after)):
            continue
        if b - len(before) < 2 or len(nxt) - b < 2:
            continue
        stop = text[b - 2 : b + 2]
        if text.find(stop) == b - 2:
            return stop, b - 2
    raise AssertionError(f"no token boundary to split a stop string across in {text!r}")


def test_stop_string_split_across_tokens(llm: LLM) -> None:
    full = _greedy(llm)
    stop, pos = _split_stop(llm, full)
    cut = _greedy(llm, stop=[stop])
    assert cut.text == full.text[:pos]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = _greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: pos + len(stop)]
    assert kept.stop_reason == stop
    # the earliest of several stop strings wins
    later = full.text[pos + 3 : pos + 6]
    both = _greedy(llm, stop=[later, stop])
    assert both.text == full.text[:pos] and both.stop_reason == stop
    kv = llm.llm_engine.engine_core.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def _stream(llm: LLM, params: SamplingParams, request_id: str) -> list[Any]:
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_delta_outputs_concatenate_to_the_final_text(llm: LLM) -> None:
    final = _greedy(llm, max_tokens=20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outs = _stream(llm, params, "delta")
    assert len(outs) > 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].text for o in outs) == final.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == final.token_ids


def test_streamed_deltas_never_show_part_of_a_stop_string(llm: LLM) -> None:
    full = _greedy(llm)
    stop, pos = _split_stop(llm, full)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop],
                            output_kind=RequestOutputKind.DELTA)
    outs = _stream(llm, params, "delta-stop")
    shown = ""
    for o in outs:
        shown += o.outputs[0].text
        assert stop[:2] not in shown[pos:] or o.finished
    assert shown == full.text[:pos]
    cumulative = _stream(llm, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop]), "cum-stop")
    for o in cumulative:
        assert full.text.startswith(o.outputs[0].text)
        assert len(o.outputs[0].text) <= pos
    assert cumulative[-1].outputs[0].text == full.text[:pos]


def test_prompt_logprobs_carry_decoded_tokens(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_logprobs[0] is None
    for token_id, record in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert record[token_id].decoded_token == tok.decode([token_id])
