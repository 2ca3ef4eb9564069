"""LLaVA served: chat with image_url parts (data: URLs; http(s) only from --allowed-media-domains, tested
against a local HTTP server on 127.0.0.1) equals the offline answer, through the openai SDK; every bad
image input is a 400 with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from typing import Any

import httpx
import pytest

from pagoda.testing.tiny_llava import random_image

SERVE = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "256", "--block-size", "16", "--limit-mm-per-prompt",
         '{"image": 1}']


def data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server on 127.0.0.1 serving /cat.png (and /big.png over the size limit: not used)."""
    image = random_image(7)
    body = png_bytes(image)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image
    server.shutdown()


@pytest.fixture(scope="module")
def server(start_server, tiny_llava):
    return start_server([str(tiny_llava[0]), *SERVE, "--allowed-media-domains", "127.0.0.1"])


def chat_body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "w7"}]}],
            "max_tokens": 6, "temperature": 0}


def test_served_chat_equals_offline(server, tiny_llava, image_host) -> None:
    from openai import OpenAI

    from pagoda import LLM, SamplingParams

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    image = random_image(8)
    served = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": "w7"}]}])
    url, hosted = image_host
    fetched = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url + "/cat.png"}},
                                               {"type": "text", "text": "w7"}]}])
    llm = LLM(str(tiny_llava[0]), dtype="float32", max_model_len=256, block_size=16)
    params = SamplingParams(max_tokens=6, temperature=0)
    for reply, img in ((served, image), (fetched, hosted)):
        offline = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                          {"type": "text", "text": "w7"}]}], params)[0]
        assert reply.choices[0].message.content == offline.outputs[0].text
        assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streamed_equals_plain_and_n2_runs(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(random_image(9))}},
                                             {"type": "text", "text": "w7"}]}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == plain.choices[0].message.content
    # n > 1 runs each sequence on the one processed prompt (seeded sampling: the same seed, the same text)
    two = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=1.0, n=2, seed=3)
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=1.0, n=2, seed=3)
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]


@pytest.mark.parametrize("parts, message", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}}],
     "could not be decoded"),
    ([{"type": "image_url", "image_url": {"url": "data:audio/wav;base64,AAAA"}}], "unsupported media type"),
    ([{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}], "not allowed"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], "allowed-local-media-path"),
    ([{"type": "image_url", "image_url": {"url": data_url(random_image(1))}}] * 2, "limit_mm_per_prompt"),
    ([{"type": "image_url", "image_url": {"url": data_url(random_image(1)), "detail": "high"}}], "detail"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "input_audio"),
])
def test_bad_images_are_400(server, parts, message) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(*parts), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError"
    ok = httpx.post(server.url + "/v1/chat/completions",
                    json=chat_body({"type": "image_url", "image_url": {"url": data_url(random_image(2))}}), timeout=60)
    assert ok.status_code == 200


def test_http_fetch_refused_without_allowed_domain(start_server, tiny_llava, image_host) -> None:
    url, _ = image_host
    plain = start_server([str(tiny_llava[0]), *SERVE])
    r = httpx.post(plain.url + "/v1/chat/completions",
                   json=chat_body({"type": "image_url", "image_url": {"url": url + "/cat.png"}}), timeout=60)
    assert r.status_code == 400 and "--allowed-media-domains" in r.json()["error"]["message"]


def test_text_only_model_refuses_image_parts(start_server, tiny_model_dir) -> None:
    from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

    path, _ = tiny_model_dir("llama")
    save_tiny_tokenizer(path, 384)
    text_server = start_server([str(path), "--served-model-name", "m", "--dtype", "float32", "--max-model-len", "128",
                                "--chat-template", "{{ messages[0]['role'] }}"])
    r = httpx.post(text_server.url + "/v1/chat/completions",
                   json=chat_body({"type": "image_url", "image_url": {"url": data_url(random_image(3))}}), timeout=60)
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
