"""`pagoda serve --tensor-parallel-size 2 --pipeline-parallel-size 2 --distributed-executor-backend ray`.

With no ``RAY_ADDRESS`` the server starts a private Ray instance on 127.0.0.1 (four rank actors); its greedy
completions equal the single-process engine's on the same tiny model, and stopping the server leaves no
Ray process behind. Skipped only where ray cannot be imported (it is in the test extra).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import transformers

pytest.importorskip("ray")

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.testing.model_parity import build_tiny_model, save_tiny_model  # noqa: E402
from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

PROMPTS = ["w5 w6 w7", "w1 w2", "w9 w3 w3 w8 w1"]


def _ray_pids_of(parent: int) -> list[int]:
    """Ray's processes (raylet, gcs, workers) the server started: its descendants named like Ray's."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), comm))
    found, stack = [], [parent]
    while stack:
        for pid, comm in children.get(stack.pop(), []):
            stack.append(pid)
            if "ray" in comm.lower() or "gcs" in comm.lower():
                found.append(pid)
    return found


def test_serve_tp2_pp2_on_ray_matches_one_process(tmp_path: Path, start_server: Any) -> None:
    import httpx

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   max_position_embeddings=256, vocab_size=128, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = save_tiny_model(build_tiny_model(cfg), tmp_path / "m")
    save_tiny_tokenizer(model, 128)

    reference = LLM(model=str(model), dtype="float32", max_model_len=256, num_kv_blocks=64)
    expected = [o.outputs[0].text for o in reference.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    del reference

    server = start_server([str(model), "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                           "--distributed-executor-backend", "ray", "--dtype", "float32", "--max-model-len", "256"],
                          timeout=600)  # five processes and a Ray instance start on two cores
    assert "ray" in server.output().lower(), server.output()
    got = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == expected
    ray_pids = _ray_pids_of(server.proc.pid)
    assert ray_pids, "the server started no Ray process"
    server.stop()
    deadline = time.monotonic() + 30
    while _alive(ray_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(ray_pids), f"Ray processes left behind: {_alive(ray_pids)}"


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie is not)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive
