"""Bounded fuzzing of the pooling endpoints with hypothesis-generated bodies (as test_server_fuzz.py does for generation).

Two tiny BERT servers: an embedding model (/v1/embeddings, /pooling, cosine
/score and /rerank) and a cross-encoder (/classify, /score, /rerank). Every
body must be answered with 2xx or an OpenAI-style 4xx, never 5xx, and both
servers must stay healthy and keep answering afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.testing.tiny_tokenizer import save_tiny_bert_tokenizer

VOCAB = 64
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(-5, 200), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
WORDS = st.lists(st.integers(5, 63).map(lambda i: f"w{i}"), max_size=12).map(" ".join)
IDS = st.lists(st.integers(0, 63), min_size=1, max_size=20)
TEXT = st.one_of(WORDS, st.text(max_size=12))
# Well-formed values, so that many bodies reach the engine ...
VALID = {
    "truncate_prompt_tokens": st.one_of(st.integers(1, 64), st.just(-1)),
    "request_id": st.uuids().map(str),
    "user": st.text(max_size=4),
}
VALID_INPUT = st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3), IDS, st.lists(IDS, min_size=1, max_size=3))
EMBED = {
    **VALID,
    "input": VALID_INPUT,
    "encoding_format": st.sampled_from(["float", "base64"]),
    "normalize": st.booleans(),
    "add_special_tokens": st.booleans(),
}
SCORE = {**VALID, "text_1": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=2)),
         "text_2": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=2))}
RERANK = {
    **VALID,
    "query": WORDS,
    "documents": st.lists(st.one_of(WORDS, st.fixed_dictionaries({"text": WORDS})), min_size=1, max_size=4),
    "top_n": st.integers(0, 5),
    "return_documents": st.booleans(),
}
# ... and junk that must be refused with a 4xx (half the bodies get some of it, overriding valid fields).
SMALL_INT = st.one_of(st.integers(-3, 70), JUNK)
INPUT = st.one_of(TEXT, st.lists(TEXT, max_size=3), st.lists(st.integers(-2, 80), max_size=70),
                  st.lists(st.lists(st.integers(-1, 70), max_size=5), max_size=3), JUNK)
JUNK_FIELDS = {
    "model": st.one_of(st.sampled_from(["tiny-embed", "tiny-cross"]), st.text(max_size=6), JUNK),
    "truncate_prompt_tokens": SMALL_INT,
    "priority": SMALL_INT,
    "request_id": JUNK,
    "use_activation": st.one_of(st.booleans(), JUNK),
    "dimensions": SMALL_INT,
    "unknown_field": JUNK,
    "input": INPUT,
    "encoding_format": st.one_of(st.sampled_from(["float", "base64", "hex"]), JUNK),
    "task": st.one_of(st.sampled_from(["embed", "classify", "score", "encode", "token_embed", "nope"]), JUNK),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                          "content": TEXT}), max_size=2), JUNK),
    "data": JUNK,
    "text_1": st.one_of(TEXT, st.lists(TEXT, max_size=3), JUNK),
    "text_2": st.one_of(TEXT, st.lists(TEXT, max_size=3), JUNK),
    "query": st.one_of(TEXT, JUNK),
    "documents": st.one_of(st.lists(st.one_of(TEXT, st.fixed_dictionaries({"text": TEXT})), max_size=4), JUNK),
    "top_n": SMALL_INT,
}


def _save(path: Path, kind: str) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, num_labels=1)
    model = tf.BertModel(config, add_pooling_layer=False) if kind == "embed" else tf.BertForSequenceClassification(config)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_bert_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, start_server: Any) -> dict[str, Any]:
    return {kind: start_server([str(_save(tmp_path_factory.mktemp(f"fuzz-{kind}"), kind)), "--dtype", "float32",
                                "--served-model-name", f"tiny-{kind}"])
            for kind in ("embed", "cross")}


STATUSES: list[int] = []


def _check(server: Any, path: str, body: dict[str, Any]) -> None:
    # encoded here: the fuzzer's inf values (JSON's common Infinity extension) must reach the server
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"},
                   timeout=60)
    STATUSES.append(r.status_code)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def _body(fields: dict[str, Any], *required: str) -> st.SearchStrategy[dict[str, Any]]:
    """Well-formed bodies with the required fields and some optional ones; half of them get junk on top."""
    clean = st.fixed_dictionaries({k: fields[k] for k in required},
                                  optional={k: v for k, v in fields.items() if k not in required})
    dirty = st.fixed_dictionaries({}, optional=JUNK_FIELDS)
    return st.one_of(clean, st.tuples(clean, dirty).map(lambda pair: {**pair[0], **pair[1]}))


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)


@FUZZ
@given(body=_body(EMBED, "input"), path=st.sampled_from(["/v1/embeddings", "/pooling", "/classify"]),
       kind=st.sampled_from(["embed", "cross"]))
def test_fuzz_embeddings_pooling_classify(servers: dict[str, Any], body: dict[str, Any], path: str, kind: str) -> None:
    _check(servers[kind], path, body)


@FUZZ
@given(body=_body(SCORE, "text_1", "text_2"), kind=st.sampled_from(["embed", "cross"]))
def test_fuzz_score(servers: dict[str, Any], body: dict[str, Any], kind: str) -> None:
    _check(servers[kind], "/score", body)


@FUZZ
@given(body=_body(RERANK, "query", "documents"), kind=st.sampled_from(["embed", "cross"]))
def test_fuzz_rerank(servers: dict[str, Any], body: dict[str, Any], kind: str) -> None:
    _check(servers[kind], "/rerank", body)


def test_servers_healthy_after_fuzzing(servers: dict[str, Any]) -> None:
    # the fuzzing reached the engine, not only the validation
    assert STATUSES.count(200) >= len(STATUSES) // 5, [(c, STATUSES.count(c)) for c in sorted(set(STATUSES))]
    for server in servers.values():
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(servers["embed"].url + "/v1/embeddings", json={"input": ["w5 w6", "w7"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    r = httpx.post(servers["cross"].url + "/rerank", json={"query": "w5", "documents": ["w6", "w7 w8"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == 2
