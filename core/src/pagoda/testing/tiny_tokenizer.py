"""A tiny word-level tokenizer to save beside a tiny random checkpoint, so it loads and serves text.

Tests of a model family (and of anything served) need a tokenizer whose
vocabulary fits the tiny model's; a real one has tens of thousands of ids.
Words are ``w0``, ``w1``, ... separated by spaces; id 0 is ``<unk>``, 1 ``<s>``
and 2 ``</s>`` (the EOS).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def save_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write tokenizer.json and its config into ``path`` (a model directory); returns ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.save_pretrained(str(path))
    return Path(path)
