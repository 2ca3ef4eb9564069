"""A tiny random Idefics3 (SmolVLM's class) checkpoint with a real ``Idefics3Processor``, saved to a
directory: what the Idefics3 tests serve, no hub.

The tokenizer is the tiny word-level one plus Idefics3's special tokens (``<fake_token_around_image>``,
``<image>``, ``<end_of_utterance>``, ``<global-img>`` and the 36 ``<row_i_col_j>`` tile tags). Frames are
56 pixels in 14-pixel patches (16 patches, pixel-shuffled by 2 into 4 ``<image>`` tokens); images are first
resized to a longest edge of 112, so a wide image is 1x2 tiles and a large square one 2x2, plus the global
frame each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

FRAME_SIZE = 56
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (FRAME_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)))
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} "
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_idefics3(path: str | Path, seed: int = 0) -> tuple[Path, Any]:
    """Write the checkpoint, tokenizer and processor into ``path``; -> (path, the transformers model)."""
    import torch
    import transformers as tf

    path = Path(path)
    save_tiny_tokenizer(path, VOCAB_SIZE - len(SPECIAL_TOKENS) - 4)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=FRAME_SIZE, patch_size=PATCH_SIZE)
    text = tf.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          initializer_range=0.3, tie_word_embeddings=False)
    config = tf.Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                               scale_factor=SCALE_FACTOR)
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    image_processor = tf.Idefics3ImageProcessorPil(size={"longest_edge": 2 * FRAME_SIZE},
                                                   max_image_size={"longest_edge": FRAME_SIZE})
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                     image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path, model
