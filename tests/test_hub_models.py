"""`pagoda serve org/name` from a Hugging Face cache on disk, offline; a missing id fails fast, naming itself.

HF_ENDPOINT points at a closed local port: a request to the hub would fail
(after huggingface_hub's retries, tens of seconds) instead of downloading.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

SHA = "c" * 40


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, _ = tiny_model_dir("llama")
    cache = tmp_path_factory.mktemp("hf-home") / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for file in src.iterdir():
        shutil.copy(file, snapshot / file.name)
    save_tiny_tokenizer(snapshot, 384)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return cache


def _offline_env(cache: Path) -> dict[str, str]:
    # HF_HOME, not HF_HUB_CACHE: the hub cache is HF_HOME/hub
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent), "HF_ENDPOINT": "http://127.0.0.1:9"}


def test_serve_a_hub_id_offline(hub_cache: Path, start_server) -> None:
    server = start_server(["tiny-org/tiny-llama", "--dtype", "float32", "--max-model-len", "128",
                           "--num-kv-blocks", "64"], env=_offline_env(hub_cache))
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny-org/tiny-llama"
    body = {"model": "tiny-org/tiny-llama", "prompt": "w5 w6 w7", "max_tokens": 5, "temperature": 0}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 5


def test_offline_missing_id_exits_fast_naming_it(hub_cache: Path) -> None:
    import os

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli.main", "generate", "w5", "--model", "nobody/nothing-here",
         "--revision", "v1"],
        env={**os.environ, **_offline_env(hub_cache)}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert "'nobody/nothing-here' at revision 'v1'" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
    assert "Traceback" not in done.stderr  # a message, not a crash
    assert time.monotonic() - started < 60
