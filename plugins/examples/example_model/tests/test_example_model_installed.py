"""The example plugin as a third party ships it: built and installed by pip, found through its entry point, served.

pip installs the distribution into a throwaway folder (``--target``), which the
subprocesses below put on PYTHONPATH: the same discovery path as a site-packages
install (``importlib.metadata`` reads its .dist-info and entry_points.txt),
without touching the environment the other tests run in.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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
    assert (target / "pagoda_example_model-0.1.0.dist-info" / "entry_points.txt").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_entry_point_loads_the_plugin_but_not_its_model_until_asked(installed: Path, example: Any) -> None:
    code = textwrap.dedent(f"""
        import sys
        from pagoda.models.registry import ModelRegistry
        from pagoda.plugins import get_plugin_manager

        pm = get_plugin_manager()
        info = {{i.name: i for i in pm.infos}}["example_model"]
        assert info.status == "loaded" and info.distribution == "pagoda-example-model", info
        assert "{example.ARCHITECTURE}" in ModelRegistry.get_supported_archs()
        assert ModelRegistry.spec_for(["{example.ARCHITECTURE}"]).cls == "pagoda_example_model.model:{example.ARCHITECTURE}"
        assert "pagoda_example_model.model" not in sys.modules, "model module imported at plugin load"
        cls = ModelRegistry.resolve_model_cls(["{example.ARCHITECTURE}"])
        assert "pagoda_example_model.model" in sys.modules
        assert sys.modules["pagoda_example_model"].__file__.startswith("{installed}"), "not the installed copy"
        print("ok", cls.__name__)
    """)
    done = subprocess.run([sys.executable, "-c", code], env=_env(installed), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", example.ARCHITECTURE]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_pagoda_serve_answers_a_completion_from_the_installed_model(
    installed: Path, example_checkpoint: Path, example: Any, tmp_path: Path
) -> None:
    import httpx

    port = _free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", str(example_checkpoint), "--host",
             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--num-kv-blocks", "32"],
            env=_env(installed), stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 240
            while True:
                assert server.poll() is None, f"pagoda serve exited:\n{log_path.read_text()[-3000:]}"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"no /health in 240 s:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.25)
            body = {"prompt": "w5 w9 w11 w40", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            state = example.checkpoint_state(seed=0)
            assert tokens == example.reference_greedy(state, [5, 9, 11, 40], 6)
            assert choice["finish_reason"] == "length"
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
    assert f"loaded {example.ARCHITECTURE}" in log_path.read_text()
