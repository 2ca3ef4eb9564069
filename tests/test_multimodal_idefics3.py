"""Idefics3 (SmolVLM's class) end to end: an image is tiles whose ``<image>`` runs are separated by text
tokens (tile tags), one placeholder span with an embed mask. Greedy output equals transformers' generate for a
mixed batch, also with chunks that end inside a span (and chunks holding only its text tokens), the encoder
runs once per image, the prefix cache keys carry the image, the encoder budget counts encoder outputs (not
the span's tokens), and the served chat route with a data-URL image equals offline."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.testing.tiny_idefics3 import IMAGE_SEQ_LEN
from pagoda.testing.tiny_llava import random_image

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
WIDE = (100, 40)  # 1x2 tiles + the global frame: 3 frames, 12 <image> tokens in a 19-token span
SQUARE = (90, 90)  # 2x2 tiles + the global frame: 5 frames, 20 <image> tokens in a 31-token span


def hf_generate(model: Any, processor: Any, text: str, images: list[Any] | None) -> list[int]:
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def processor(tiny_idefics3):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_idefics3[0])


@pytest.fixture(scope="module")
def llm(tiny_idefics3):
    return LLM(str(tiny_idefics3[0]), dtype="float32", max_model_len=256, block_size=16,
               limit_mm_per_prompt={"image": 2})


def runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner


def test_mixed_batch_matches_transformers(llm, tiny_idefics3, processor) -> None:
    a, b = random_image(0, WIDE), random_image(1, SQUARE)
    prompts = [
        ("w5 <image> w6", [a]),
        ("w5 <image> w6", [b]),  # another image of another size (more tiles)
        ("w8 w9 w10", None),  # text only, in the same batch
        ("<image> w7 <image> w11", [b, a]),  # two images in one prompt
    ]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in prompts],
                        GREEDY)
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_idefics3[1], processor, text, images), text
    assert len(outs[0].prompt_token_ids) == 2 + 19 and len(outs[1].prompt_token_ids) == 2 + 31
    features = llm.llm_engine.processor.mm_processor.process("w5 <image> w6", {"image": a})[1].features
    span = features[0].placeholder
    # the span holds the tile tags; only the <image> tokens take encoder outputs
    assert (span.offset, span.length, span.num_embeds) == (1, 19, 3 * IMAGE_SEQ_LEN)
    assert span.is_embed is not None and not span.is_embed[0] and not span.is_embed[1] and span.is_embed[2]


def test_chunked_prefill_inside_spans_encodes_once(tiny_idefics3, processor) -> None:
    # chunks of 5 tokens: chunk boundaries fall inside both spans, and some chunks hold only a span's tile tags;
    # the encoder budget (5) is smaller than either image, which then runs alone in its step
    engine = LLM(str(tiny_idefics3[0]), dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=5,
                 enable_prefix_caching=False)
    image, other = random_image(2, SQUARE), random_image(3, WIDE)
    text = "w5 w6 w7 <image> w8 <image>"
    out = engine.generate({"prompt": text, "multi_modal_data": {"image": [image, other]}}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_idefics3[1], processor, text, [image, other])
    assert runner(engine).encoder_runner.num_encoded == 2  # once per image, not once per chunk


def test_prefix_cache_keys_carry_the_image(llm) -> None:
    # 16 text tokens (one block), the image's 19-token span, 15 more: three full blocks, two covering the span
    prefix = " ".join(f"w{i}" for i in range(5, 21))
    text = f"{prefix} <image> " + " ".join(f"w{i}" for i in range(30, 45))
    first, again, other = random_image(10, WIDE), random_image(10, WIDE), random_image(11, WIDE)
    cached = []
    for image in (first, again, other):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
        cached.append(out.num_cached_tokens)
    assert cached[1] == 48  # the repeated image hits every full block
    assert cached[2] == 16  # another image with the same layout: only the text block before it


def test_repeated_image_is_not_encoded_again(llm) -> None:
    image = random_image(20, WIDE)
    encoder = runner(llm).encoder_runner
    llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image}}, GREEDY)
    before = encoder.num_encoded
    llm.generate({"prompt": "w6 w7 <image>", "multi_modal_data": {"image": image}}, GREEDY)
    assert encoder.num_encoded == before


def test_encoder_budget_counts_encoder_outputs(tiny_idefics3, processor) -> None:
    # a budget of 12 takes the wide image (12 outputs, a 19-token span) and refuses the square one (20)
    engine = LLM(str(tiny_idefics3[0]), dtype="float32", max_model_len=256, block_size=16,
                 max_num_encoder_input_tokens=12)
    wide = random_image(5, WIDE)
    out = engine.generate({"prompt": "w5 <image> w6", "multi_modal_data": {"image": wide}}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_idefics3[1], processor, "w5 <image> w6", [wide])
    with pytest.raises(ValueError, match="20 encoder outputs, more than the encoder budget of 12"):
        engine.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": random_image(6, SQUARE)}}, GREEDY)


def data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_served_chat_equals_offline(start_server, tiny_idefics3, llm) -> None:
    from openai import OpenAI

    server = start_server([str(tiny_idefics3[0]), "--served-model-name", "m", "--dtype", "float32",
                           "--max-model-len", "256", "--block-size", "16"])
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    image = random_image(8, SQUARE)
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "w7"}]
    served = client.chat.completions.create(model="m", max_tokens=6, temperature=0,
                                            messages=[{"role": "user", "content": content}])
    offline = llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=6, temperature=0))[0]
    assert served.choices[0].message.content == offline.outputs[0].text
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids) > 31
