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


BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def save_tiny_bert_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """The same word-level vocabulary with BERT's special tokens and post-processing, for tiny encoders.

    ids 0-4 are ``[PAD] [UNK] [CLS] [SEP] [MASK]``, then ``w5`` ... A text becomes
    ``[CLS] text [SEP]``; a pair ``[CLS] a [SEP] b [SEP]`` with token type 1 on ``b [SEP]``,
    so cross-encoder inputs carry their token type ids as a BERT tokenizer's do.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(BERT_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(BERT_SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(BERT_SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(BERT_SPECIAL_TOKENS), vocab_size)})
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    tokenizer.save_pretrained(str(path))
    return Path(path)
