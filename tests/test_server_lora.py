"""Multi-LoRA over HTTP: --lora-modules adapters, /v1/models with their parent, a request's model naming an
adapter, runtime load/unload, and every bad adapter a 4xx with the server still serving."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.lora_utils import make_adapter

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    import transformers as tf

    from tests.conftest import TINY

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lora-server")
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, rope_theta=10000.0)).eval()
    model.save_pretrained(root / "base", safe_serialization=True)
    refs = {
        "sql": make_adapter(model, root / "sql", r=8, target_modules=["q_proj", "v_proj"], seed=1),
        "chat": make_adapter(model, root / "chat", r=16, target_modules=["o_proj", "gate_proj", "down_proj"], seed=2),
        "late": make_adapter(model, root / "late", r=4, target_modules=["k_proj", "up_proj"], seed=3),
    }
    shutil.copytree(root / "sql", root / "dora")
    cfg = json.loads((root / "dora" / "adapter_config.json").read_text())
    (root / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    return root, model, refs


@pytest.fixture(scope="module")
def server(tiny, start_server) -> Any:
    root, _, _ = tiny
    return start_server([str(root / "base"), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256",
                         "--num-kv-blocks", "128", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                         "--lora-modules", f"sql={root / 'sql'}",
                         "--lora-modules", json.dumps({"name": "chat", "path": str(root / "chat"),
                                                       "base_model_name": "tiny-base"}),
                         "--served-model-name", "tiny"],
                        env={"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "1"})


def _complete(server: Any, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "return_tokens_as_token_ids": True}, timeout=60)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def _ids(server: Any, model: str, prompt: list[int]) -> list[int]:
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                        "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                        "return_tokens_as_token_ids": True}, timeout=60)
    return _tokens(r)


def test_models_lists_adapters_with_their_parent(server: Any) -> None:
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["tiny"]["parent"] is None
    assert cards["sql"]["parent"] == "tiny" and cards["chat"]["parent"] == "tiny-base"
    assert cards["sql"]["root"].endswith("sql")


def test_model_field_names_the_adapter(server: Any, tiny, hf_greedy) -> None:
    _, base, refs = tiny
    rng = random.Random(1)
    for name, ref in [("tiny", base), ("sql", refs["sql"]), ("chat", refs["chat"])]:
        prompt = [rng.randrange(384) for _ in range(12)]
        assert _ids(server, name, prompt) == hf_greedy(ref, prompt, NEW_TOKENS), name
    assert _complete(server, "sql", [1, 2]).json()["model"] == "sql"  # vLLM reports the adapter's name


def test_runtime_load_and_unload(server: Any, tiny, hf_greedy) -> None:
    root, _, refs = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r = _complete(server, "late", prompt)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert _ids(server, "late", prompt) == hf_greedy(refs["late"], prompt, NEW_TOKENS)
    again = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")},
                       timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(server, "late", prompt).status_code == 404
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 404


@pytest.mark.parametrize(("name", "path", "status", "text"), [
    ("gone", "/nonexistent/adapter", 404, "no directory"),
    ("dora", "dora", 400, "DoRA"),
])
def test_bad_adapters_are_4xx_and_the_server_keeps_serving(server: Any, tiny, hf_greedy, name: str, path: str,
                                                           status: int, text: str) -> None:
    root, _, refs = tiny
    full = path if path.startswith("/") else str(root / path)
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": full}, timeout=60)
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert text in body["message"] and repr(name) in body["message"]
    prompt = [7, 7, 7, 1]
    assert _ids(server, "sql", prompt) == hf_greedy(refs["sql"], prompt, NEW_TOKENS)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_adapter_on_a_base_only_endpoint_is_a_400(server: Any) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "sql", "input": [1, 2, 3]}, timeout=30)
    assert 400 <= r.status_code < 500


def test_lora_requests_info_gauge(server: Any) -> None:
    _ids(server, "sql", [1, 2, 3])
    lines = [line for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
             if line.startswith("pagoda:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0], lines


def test_filesystem_resolver_serves_an_adapter_nobody_loaded(tiny, start_server, hf_greedy) -> None:
    """PAGODA_LORA_RESOLVER_CACHE_DIR: a request naming <dir>/<name> gets it loaded and served."""
    root, _, refs = tiny
    cache = root / "resolver-cache"
    cache.mkdir(exist_ok=True)
    if not (cache / "found").exists():
        shutil.copytree(root / "late", cache / "found")
    server = start_server([str(root / "base"), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256",
                           "--num-kv-blocks", "64", "--enable-lora", "--max-lora-rank", "16"],
                          env={"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "1", "PAGODA_LORA_RESOLVER_CACHE_DIR": str(cache)})
    prompt = [9, 8, 7, 6, 5]
    assert _ids(server, "found", prompt) == hf_greedy(refs["late"], prompt, NEW_TOKENS)
    assert "found" in {c["id"] for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert _complete(server, "not-there", prompt).status_code == 404
