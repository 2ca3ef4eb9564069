"""LLaVA 1.5 end to end offline: greedy output with images equals transformers' generate on the same
processor outputs; mixed batches, chunked prefill across an image's placeholders, the encoder cache, the
prefix cache keyed by image content, chat content parts, and every bad input refused with a ValueError."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.testing.tiny_llava import IMAGE_TOKENS, random_image

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def hf_generate(model: Any, processor: Any, text: str, images: list[Any] | None) -> list[int]:
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def data_url(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def processor(tiny_llava):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_llava[0])


@pytest.fixture(scope="module")
def llm(tiny_llava):
    return LLM(str(tiny_llava[0]), dtype="float32", max_model_len=256, block_size=16,
               limit_mm_per_prompt={"image": 2})


def runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner


def test_mixed_batch_matches_transformers(llm, tiny_llava, processor) -> None:
    model = tiny_llava[1]
    a, b = random_image(0), random_image(1, (50, 70))
    prompts = [
        ("w5 <image> w6", [a]),
        ("w5 <image> w6", [b]),  # same layout, another image
        ("w8 w9 w10", None),  # text only, in the same batch
        ("<image> w7 <image> w11", [b, a]),  # two images in one prompt
    ]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in prompts],
                        GREEDY)
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(model, processor, text, images), text
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image reaches the model
    assert len(outs[0].prompt_token_ids) == 2 + IMAGE_TOKENS


def test_decode_steps_replay_graphs(llm) -> None:
    # image steps run eagerly on input embeddings; the decode steps after them replay the captured graphs
    # (the platform's: CPU kernel graphs here), whose capture finds the decoder's tensors under language_model
    graphs = runner(llm).graphs
    llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": random_image(30)}}, GREEDY)
    assert graphs is not None and not graphs.off and graphs.num_replays > 0


def test_chunked_prefill_splits_placeholders_and_encodes_once(tiny_llava, processor) -> None:
    # chunks of 6 tokens: every image's 16 placeholders span three chunks; the encoder budget (6) is smaller
    # than an image, which then runs alone in its step
    engine = LLM(str(tiny_llava[0]), dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=6,
                 enable_prefix_caching=False)
    image, other = random_image(2), random_image(3)
    text = "w5 w6 w7 <image> w8 <image>"
    out = engine.generate({"prompt": text, "multi_modal_data": {"image": [image, other]}}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_llava[1], processor, text, [image, other])
    assert runner(engine).encoder_runner.num_encoded == 2  # once per image, not once per chunk


def test_prefix_cache_keys_carry_the_image(llm) -> None:
    # 16 text tokens (one block) then the image's 16 placeholders (the next block), then more text
    prefix = " ".join(f"w{i}" for i in range(5, 21))
    text = f"{prefix} <image> w30 w31"
    first, again, other = random_image(10), random_image(10), random_image(11)
    cached = []
    for image in (first, again, other):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
        cached.append(out.num_cached_tokens)
    assert cached[1] == 32  # the repeated image (equal pixels, another object) hits both blocks
    assert cached[2] == 16  # another image with the same layout: only the text block before it


def test_repeated_image_is_not_encoded_again(llm) -> None:
    image = random_image(20)
    encoder = runner(llm).encoder_runner
    llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image}}, GREEDY)
    before = encoder.num_encoded
    # another prompt, same image, no prefix hit on its blocks (other text first): the encoder cache serves it
    llm.generate({"prompt": "w6 w7 <image>", "multi_modal_data": {"image": image}}, GREEDY)
    assert encoder.num_encoded == before


def test_lost_encoder_output_is_recomputed(llm, tiny_llava, processor) -> None:
    # a step that raised after the scheduler counted an image as cached leaves the runner without it: the
    # runner encodes it from the request's own tensors instead of failing the next step
    image = random_image(22)
    llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image}}, GREEDY)
    runner(llm).encoder_runner.encoder_cache.clear()
    text = "w9 w9 <image> w6"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_generate(tiny_llava[1], processor, text, [image])


def test_processor_kwargs_reach_the_processor_and_the_hash(llm) -> None:
    image = random_image(21)
    plain = llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image}}, GREEDY)[0]
    # do_normalize=False changes the pixels the tower sees, so the answer (and the item's hash) differ
    raw = llm.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image},
                        "mm_processor_kwargs": {"do_normalize": False}}, GREEDY)[0]
    assert plain.outputs[0].token_ids != raw.outputs[0].token_ids


def test_chat_content_parts_equal_generate(llm) -> None:
    image = random_image(4)
    expected = llm.generate({"prompt": "user: <image> w7 \nassistant: ", "multi_modal_data": {"image": image},
                             "mm_processor_kwargs": {"add_special_tokens": False}}, GREEDY)[0]
    for part in ({"type": "image_url", "image_url": {"url": data_url(image)}},
                 {"type": "image_pil", "image_pil": image}):
        out = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "w7"}]}], GREEDY)[0]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert out.prompt_token_ids == expected.prompt_token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "w5 <image>", "multi_modal_data": {"image": "not an image"}}, "must be a PIL.Image"),
    ({"prompt": "w5 <image>", "multi_modal_data": {"video": [1]}}, "unsupported modality 'video'"),
    ({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [random_image(0)] * 3}},
     "limit_mm_per_prompt"),
    ({"prompt": "w5", "multi_modal_data": {"image": random_image(0)}}, "processor refused"),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(0)}}, "needs a text prompt"),
    ("w5 <image> w6", "placeholder tokens but no multi_modal_data"),
])
def test_bad_inputs_are_value_errors(llm, prompt, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)
    # the engine is unaffected
    assert len(llm.generate("w5 w6", GREEDY)[0].outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "could not be decoded"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported media type 'text/plain'"),
    ("data:image/png;base64,@@@", "does not decode"),
    ("http://127.0.0.1:9/x.png", "not allowed"),
    ("file:///etc/hostname", "allowed-local-media-path"),
    ("ftp://127.0.0.1/x.png", "not supported"),
])
def test_bad_image_urls_are_value_errors(llm, url, message) -> None:
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(ValueError, match=message):
        llm.chat(conversation, GREEDY)


def test_item_over_a_set_encoder_budget_is_refused(tiny_llava) -> None:
    engine = LLM(str(tiny_llava[0]), dtype="float32", max_model_len=128, block_size=16,
                 max_num_encoder_input_tokens=8)
    with pytest.raises(ValueError, match="more than the encoder budget of 8"):
        engine.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": random_image(0)}}, GREEDY)


def test_local_media_path(tiny_llava, tmp_path) -> None:
    image = random_image(5)
    image.save(tmp_path / "cat.png")
    engine = LLM(str(tiny_llava[0]), dtype="float32", max_model_len=128, block_size=16,
                 allowed_local_media_path=str(tmp_path))
    text_part = {"type": "text", "text": "w7"}
    by_file = engine.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/cat.png"}}, text_part]}], GREEDY)[0]
    inline = engine.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, text_part]}],
                         GREEDY)[0]
    assert by_file.outputs[0].token_ids == inline.outputs[0].token_ids
    with pytest.raises(ValueError, match="must be under"):
        engine.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/../x.png"}}]}], GREEDY)


def test_text_only_model_refuses_images(tiny_model_dir) -> None:
    from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

    path, _ = tiny_model_dir("llama")
    save_tiny_tokenizer(path, 384)
    engine = LLM(str(path), dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="text-only"):
        engine.generate({"prompt": "w5", "multi_modal_data": {"image": random_image(0)}}, GREEDY)
    with pytest.raises(ValueError, match="text-only"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
                    GREEDY, chat_template="{{ messages[0]['content'] }}")
    assert len(engine.generate("w5 w6", GREEDY)[0].outputs[0].token_ids) == MAX_TOKENS
