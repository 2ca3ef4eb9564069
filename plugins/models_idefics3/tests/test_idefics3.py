"""The Idefics3 family on its own: the SigLIP tower and connector against transformers' image features for
images of different tile counts, the processed prompt split into one span per image (``is_embed`` on its
``<image>`` tokens only) with its own frames, the decoder reached through the registry, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.models.interface import supports_multimodal
from pagoda.multimodal.inputs import PlaceholderRange
from pagoda.testing.tiny_idefics3 import IMAGE_SEQ_LEN, save_tiny_idefics3
from pagoda.testing.tiny_llava import random_image
from pagoda_models_idefics3.idefics3 import Idefics3ForConditionalGeneration

SIZES = [(100, 40), (30, 30), (40, 100)]  # 1x2, 2x2 and 2x1 tiles, each + the global frame


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoProcessor

    path, model = save_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
    return path, model, AutoProcessor.from_pretrained(path)


def _ours(hf_config, weights) -> Idefics3ForConditionalGeneration:
    model = Idefics3ForConditionalGeneration(hf_config, torch.float32)
    model.load_weights(weights)
    return model.eval()


def _checkpoint(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors")).items()


def _processed(processor, text: str, images):
    out = processor(text=text, images=images, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    return ids, {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}, out


@pytest.mark.parametrize("layout", ["state_dict", "save_pretrained"])
def test_image_features_match_transformers(tiny, layout: str) -> None:
    path, hf, processor = tiny
    ours = _ours(hf.config, hf.state_dict().items() if layout == "state_dict" else _checkpoint(path))
    images = [random_image(i, size) for i, size in enumerate(SIZES)]
    ids, tensors, out = _processed(processor, "w5 <image> w6 <image> w7 <image>", images)
    items = ours.split_mm_items(processor, ids, tensors, len(images))
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=out["pixel_values"],
                                               pixel_attention_mask=out["pixel_attention_mask"]).pooler_output
        got = ours.embed_multimodal([data for _, data in items])
    expected = torch.cat(list(expected))
    assert [g.shape[0] for g in got] == [3 * IMAGE_SEQ_LEN, 5 * IMAGE_SEQ_LEN, 3 * IMAGE_SEQ_LEN]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)


def test_unsplit_images_are_one_frame_each(tiny) -> None:
    # do_image_splitting=False (an mm_processor_kwargs the processor takes): each image is its global frame only
    _, hf, processor = tiny
    ours = _ours(hf.config, hf.state_dict().items())
    images = [random_image(i, size) for i, size in enumerate(SIZES[:2])]
    out = processor(text="w5 <image> w6 <image>", images=images, return_tensors="pt", do_image_splitting=False)
    ids = out["input_ids"][0].tolist()
    items = ours.split_mm_items(processor, ids, {k: v for k, v in out.items() if k.startswith("pixel")}, 2)
    assert [(r.length, r.num_embeds) for r, _ in items] == [(IMAGE_SEQ_LEN + 3, IMAGE_SEQ_LEN)] * 2
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=out["pixel_values"],
                                               pixel_attention_mask=out["pixel_attention_mask"]).pooler_output
        got = ours.embed_multimodal([data for _, data in items])
    torch.testing.assert_close(torch.cat(got), torch.cat(list(expected)), atol=1e-5, rtol=1e-5)


def test_split_marks_only_image_tokens(tiny) -> None:
    _, hf, processor = tiny
    images = [random_image(0, SIZES[0]), random_image(1, SIZES[1])]
    ids, tensors, out = _processed(processor, "w5 <image> w6 w7 <image> w8", images)
    items = Idefics3ForConditionalGeneration.split_mm_items(processor, ids, tensors, 2)
    image_id = hf.config.image_token_id
    frames = 0
    for (r, data), num_frames in zip(items, (3, 5)):
        span = ids[r.offset:r.end]
        assert span[0] == span[-1] == processor.fake_image_token_id  # the whole span, tile tags included
        assert r.is_embed == tuple(t == image_id for t in span)
        assert r.num_embeds == num_frames * IMAGE_SEQ_LEN < r.length
        torch.testing.assert_close(data["pixel_values"], out["pixel_values"][:, frames:frames + num_frames])
        frames += num_frames
    # text between the two spans stays outside both; every <image> token is in one
    assert items[0][0].end < items[1][0].offset
    assert sum(r.num_embeds for r, _ in items) == ids.count(image_id)


def test_placeholder_embeds_in_a_chunk() -> None:
    r = PlaceholderRange(10, 6, (False, True, True, False, True, False))
    assert r.num_embeds == 3
    assert r.embeds_in(10, 13) == ([1, 2], 0, 2)  # a chunk ending inside the span
    assert r.embeds_in(13, 16) == ([1], 2, 3)  # the next chunk reads on from the third output
    assert r.embeds_in(15, 16) == ([], 3, 3)  # a chunk of only a text token of the span
    assert PlaceholderRange(0, 4).embeds_in(1, 3) == ([0, 1], 1, 3)
    with pytest.raises(ValueError, match="is_embed has 2 entries"):
        PlaceholderRange(0, 3, (True, False))


def test_wrong_item_count_and_layout_are_refused(tiny) -> None:
    _, _, processor = tiny
    ids, tensors, _ = _processed(processor, "w5 <image>", [random_image(0, SIZES[0])])
    with pytest.raises(ValueError, match="1 image span"):
        Idefics3ForConditionalGeneration.split_mm_items(processor, ids, tensors, 2)
    # a <fake_token_around_image> written by the user outside an image's expansion
    ids = [*ids, processor.fake_image_token_id, 5]
    with pytest.raises(ValueError, match="Idefics3's layout"):
        Idefics3ForConditionalGeneration.split_mm_items(processor, ids, tensors, 2)


def test_decoder_comes_from_the_registry(tiny) -> None:
    ours = Idefics3ForConditionalGeneration(tiny[1].config, torch.float32)
    assert type(ours.language_model).__name__ == "LlamaForCausalLM"
    assert supports_multimodal(ours) and supports_multimodal(Idefics3ForConditionalGeneration)


def test_unknown_checkpoint_tensor_is_named(tiny) -> None:
    weights = [*tiny[1].state_dict().items(), ("model.perceiver.weight", torch.zeros(4))]
    with pytest.raises(ValueError, match="perceiver"):
        _ours(tiny[1].config, weights)


def test_padded_frame_is_refused(tiny) -> None:
    ours = Idefics3ForConditionalGeneration(tiny[1].config, torch.float32)
    mask = torch.ones(1, 1, 56, 56, dtype=torch.long)
    mask[..., 28:] = 0
    with pytest.raises(ValueError, match="padded pixels"):
        ours.embed_multimodal([{"pixel_values": torch.zeros(1, 1, 3, 56, 56), "pixel_attention_mask": mask}])
