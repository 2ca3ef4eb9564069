"""The LLaVA family on its own: the CLIP tower and projector against transformers' image features, both
checkpoint layouts (state_dict's ``model.vision_tower.`` and save_pretrained's ``vision_tower.``), the
decoder reached through the registry, and the configurations it refuses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pagoda.models.interface import supports_multimodal
from pagoda.testing.tiny_llava import random_image, save_tiny_llava
from pagoda_models_llava.llava import LlavaForConditionalGeneration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoProcessor

    path, model = save_tiny_llava(tmp_path_factory.mktemp("llava"))
    return path, model, AutoProcessor.from_pretrained(path)


def _ours(hf_config, weights) -> LlavaForConditionalGeneration:
    model = LlavaForConditionalGeneration(hf_config, torch.float32)
    model.load_weights(weights)
    return model.eval()


def _checkpoint(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors")).items()


@pytest.mark.parametrize("layout", ["state_dict", "save_pretrained"])
def test_image_features_match_transformers(tiny, layout: str) -> None:
    path, hf, processor = tiny
    weights = hf.state_dict().items() if layout == "state_dict" else _checkpoint(path)
    ours = _ours(hf.config, weights)
    images = [random_image(0), random_image(1, (80, 30))]
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=pixels)
        got = ours.embed_multimodal([{"pixel_values": pixels[i:i + 1]} for i in range(len(images))])
    expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
    for i, feats in enumerate(got):
        assert feats.shape == (16, hf.config.text_config.hidden_size)
        torch.testing.assert_close(feats, expected[i].reshape(feats.shape), atol=1e-5, rtol=1e-5)


def test_decoder_comes_from_the_registry(tiny) -> None:
    ours = LlavaForConditionalGeneration(tiny[1].config, torch.float32)
    assert type(ours.language_model).__name__ == "LlamaForCausalLM"
    assert supports_multimodal(ours) and supports_multimodal(LlavaForConditionalGeneration)


def test_unknown_checkpoint_tensor_is_named(tiny) -> None:
    weights = [*tiny[1].state_dict().items(), ("model.image_newline", torch.zeros(4))]
    with pytest.raises(ValueError, match="image_newline"):
        _ours(tiny[1].config, weights)


def test_feature_layer_outside_the_tower_is_refused(tiny) -> None:
    cfg = copy.deepcopy(tiny[1].config)
    cfg.vision_feature_layer = 7
    model = _ours(cfg, tiny[1].state_dict().items())
    with pytest.raises(ValueError, match="outside the tower"):
        model.embed_multimodal([{"pixel_values": torch.zeros(1, 3, 56, 56)}])


def test_other_vision_towers_are_refused(tiny) -> None:
    from transformers import SiglipVisionConfig

    cfg = copy.deepcopy(tiny[1].config)
    cfg.vision_config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=56, patch_size=14)
    with pytest.raises(ValueError, match="siglip_vision_model vision tower is not supported"):
        LlavaForConditionalGeneration(cfg, torch.float32)


def test_multiple_feature_layers_concatenate(tiny) -> None:
    cfg = copy.deepcopy(tiny[1].config)
    cfg.vision_feature_layer = [-2, -1]
    ours = LlavaForConditionalGeneration(cfg, torch.float32)
    assert ours.multi_modal_projector.linear_1.in_features == 2 * cfg.vision_config.hidden_size
