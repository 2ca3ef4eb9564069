"""A tiny random LLaVA 1.5 checkpoint with a real ``LlavaProcessor`` (a CLIP image processor and the tiny
word-level tokenizer plus ``<image>``), saved to a directory: what the multimodal tests serve, no hub.

56x56 images in 14-pixel patches: 16 patches, so with ``vision_feature_select_strategy="default"`` (the CLS
token dropped) each image is 16 placeholder tokens, one block at block_size 16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
VOCAB_SIZE = 384
# a text-first template that writes each image part as the image token (the processor expands it)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} "
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_llava(path: str | Path, seed: int = 0) -> tuple[Path, Any]:
    """Write the checkpoint, tokenizer and processor into ``path``; -> (path, the transformers model)."""
    import torch
    import transformers as tf

    path = Path(path)
    save_tiny_tokenizer(path, VOCAB_SIZE - 4)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          initializer_range=0.3, tie_word_embeddings=False)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                            vision_feature_layer=-2, vision_feature_select_strategy="default",
                            image_seq_length=IMAGE_TOKENS)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    image_processor = tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                  num_additional_image_tokens=1, vision_feature_select_strategy="default",
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path, model


def random_image(seed: int, size: tuple[int, int] = (60, 40)) -> Any:
    """A random RGB ``PIL.Image`` of ``size`` (width, height)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)
