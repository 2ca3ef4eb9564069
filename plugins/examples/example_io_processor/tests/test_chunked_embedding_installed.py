"""The example IO processor as a third party ships it: pip-installed, found through its entry point, served on /pooling.

pip installs the distribution into a throwaway folder (``--target``), which the
server's process puts on PYTHONPATH: the same discovery path as a site-packages
install, without touching the environment the other tests run in.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, example: Any) -> Path:
    pytest.importorskip("hatchling", reason="pip builds the example with its build backend, hatchling")
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--target", str(target), str(example.PLUGIN_ROOT)],
        check=True, timeout=300,
    )
    assert (target / "pagoda_example_io_processor-0.1.0.dist-info" / "entry_points.txt").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(site: Path, checkpoint: Path, log_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", str(checkpoint), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", *extra],
        env=_env(site), stdout=log, stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def server(installed: Path, bert_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url = _serve(installed, bert_checkpoint, log_path, "--io-processor-plugin", "chunked_embedding")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"pagoda serve exited:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no /health in 240 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.25)
        yield url
    finally:
        _stop(proc)
    assert "IO processor plugin chunked_embedding" in log_path.read_text()


def test_pooling_with_data_goes_through_the_plugin(server: str) -> None:
    words = [f"w{5 + (3 * i) % 50}" for i in range(50)]
    r = httpx.post(server + "/pooling", json={"data": {"text": " ".join(words), "chunk_words": 16}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] and body["created_at"] > 0
    data = body["data"]
    assert data["num_chunks"] == 4
    # the same as the weighted mean of the chunks' own embeddings, from /v1/embeddings
    chunks = [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    emb = httpx.post(server + "/v1/embeddings", json={"input": chunks}, timeout=60).json()
    vectors = np.array([d["embedding"] for d in emb["data"]])
    counts = np.array([len(c.split()) + 2 for c in chunks], dtype=np.float64)  # + [CLS] and [SEP]
    assert data["num_tokens"] == int(counts.sum()) == emb["usage"]["prompt_tokens"]
    mean = (counts[:, None] * vectors).sum(0) / counts.sum()
    np.testing.assert_allclose(data["embedding"], mean / np.linalg.norm(mean), atol=1e-5)


def test_bad_plugin_data_is_a_400_and_the_server_keeps_serving(server: str) -> None:
    for data in ({"text": ""}, {"text": "w5", "chunk_words": 0}, {"nope": 1}, "w5", {"text": "   "}):
        r = httpx.post(server + "/pooling", json={"data": data}, timeout=60)
        assert r.status_code == 400, (data, r.text)
        assert r.json()["error"]["param"] == "data"
    # requests without data are the plain /pooling endpoint
    assert httpx.post(server + "/pooling", json={"input": "w5 w6"}, timeout=60).status_code == 200
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_an_unknown_processor_name_stops_the_server_naming_the_installed_ones(
    installed: Path, bert_checkpoint: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "serve.log"
    proc, _ = _serve(installed, bert_checkpoint, log_path, "--io-processor-plugin", "nope")
    try:
        assert proc.wait(240) == 1
    finally:
        _stop(proc)
    log = log_path.read_text()
    assert "error: io_processor_plugin names the IO processor 'nope'" in log and "chunked_embedding" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
