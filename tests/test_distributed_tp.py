"""Tensor and pipeline parallelism with the mp executor: greedy parity with transformers at TP=2, PP=2 and
TP=2 x PP=2, and a worker killed mid-run.

Each test spawns two worker processes (four for TP=2 x PP=2; gloo on loopback, float32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import transformers

from pagoda.testing.model_parity import build_tiny_model, check_parity, mixed_prompts

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)


def test_llama_tp2_greedy_equals_transformers(tmp_path: Path) -> None:
    # an odd vocabulary: the vocab-parallel embedding and LM head pad it to a multiple of the ranks
    cfg = transformers.LlamaConfig(**SMALL, vocab_size=131, num_attention_heads=4, num_key_value_heads=2)
    report = check_parity(build_tiny_model(cfg, seed=1), tmp_path, prompts=mixed_prompts(131, num_prompts=8, max_len=40),
                          new_tokens=6, llm_kwargs=TP2)
    assert report.num_tokens_compared > 40
    assert report.num_cached_tokens > 0


def test_qwen3_tp2_replicated_kv_head_greedy_equals_transformers(tmp_path: Path) -> None:
    # one KV head for two ranks: it is replicated; qk-norm over each rank's heads; tied embeddings
    cfg = transformers.Qwen3Config(**SMALL, vocab_size=128, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=16, tie_word_embeddings=True)
    report = check_parity(build_tiny_model(cfg, seed=2), tmp_path, prompts=mixed_prompts(128, num_prompts=8, max_len=40),
                          new_tokens=6, llm_kwargs=TP2)
    assert report.num_tokens_compared > 40


PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}


def test_llama_pp2_uneven_stages_greedy_equals_transformers(tmp_path: Path) -> None:
    # 3 layers on 2 stages: layers 0-1 and the embedding on the first, layer 2, the norm and the LM head on the last
    cfg = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 3}, vocab_size=128, num_attention_heads=4,
                                   num_key_value_heads=2)
    report = check_parity(build_tiny_model(cfg, seed=3), tmp_path, prompts=mixed_prompts(128, num_prompts=8, max_len=40),
                          new_tokens=6, llm_kwargs=PP2)
    assert report.num_tokens_compared > 40


def test_qwen3_pp2_tied_lm_head_greedy_equals_transformers(tmp_path: Path) -> None:
    # tied embeddings: the last stage has no embedding and loads the LM head from its checkpoint tensor
    cfg = transformers.Qwen3Config(**SMALL, vocab_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, tie_word_embeddings=True)
    report = check_parity(build_tiny_model(cfg, seed=4), tmp_path, prompts=mixed_prompts(128, num_prompts=8, max_len=40),
                          new_tokens=6, llm_kwargs=PP2)
    assert report.num_tokens_compared > 40


def test_llama_tp2_pp2_greedy_equals_transformers(tmp_path: Path) -> None:
    # four ranks: two stages of two tensor-parallel ranks each
    cfg = transformers.LlamaConfig(**SMALL, vocab_size=131, num_attention_heads=4, num_key_value_heads=2)
    report = check_parity(build_tiny_model(cfg, seed=5), tmp_path, prompts=mixed_prompts(131, num_prompts=8, max_len=40),
                          new_tokens=4, llm_kwargs={**TP2, **PP2})
    assert report.num_tokens_compared > 25


def _tiny_llama(path: Path) -> Path:
    from pagoda.testing.model_parity import save_tiny_model

    cfg = transformers.LlamaConfig(**SMALL, vocab_size=128, num_attention_heads=4, num_key_value_heads=2)
    return save_tiny_model(build_tiny_model(cfg), path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_worker_killed_mid_generation_fails_requests_and_health(tmp_path: Path) -> None:
    from pagoda import SamplingParams
    from pagoda.config import EngineArgs
    from pagoda.engine.core import prepare_engine_config
    from pagoda.engine.core_client import ThreadedClient
    from pagoda.engine.messages import EngineCoreOutputs
    from pagoda.executor import ExecutorFailedError
    from pagoda.engine.messages import EngineCoreRequest

    model = _tiny_llama(tmp_path / "m")
    config = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                        num_kv_blocks=64, **TP2).create_engine_config()
    platform = prepare_engine_config(config)
    batches: list[EngineCoreOutputs] = []
    dead = threading.Event()
    client = ThreadedClient(config, platform, batches.append, lambda exc: dead.set())
    executor = client.core.model_executor
    pids = [p.pid for p in executor.workers]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(3):
            client.add_request(EngineCoreRequest(f"r{i}", [1 + i, 2, 3], params, None, 0.0))
        client.start()
        deadline = time.monotonic() + 60
        while sum(len(b.outputs) for b in batches) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(b.outputs) for b in batches) >= 6, "no tokens before the kill"
        os.kill(pids[1], signal.SIGKILL)
        assert dead.wait(60), "the engine did not notice the dead worker"
        failed = {rid: exc for b in batches for rid, exc in b.failed.items()}
        assert set(failed) == {"r0", "r1", "r2"}
        assert all(isinstance(exc, ExecutorFailedError) and "rank 1" in str(exc) for exc in failed.values())
        assert isinstance(client.dead_error, ExecutorFailedError)
        with pytest.raises(ExecutorFailedError, match="rank 1"):
            client.core.check_health()
    finally:
        client.shutdown()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker process outlived the engine"


def test_hung_worker_times_out_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda import SamplingParams
    from pagoda.config import EngineArgs
    from pagoda.engine.core import EngineCore, prepare_engine_config
    from pagoda.executor import ExecutorFailedError
    from pagoda.engine.messages import EngineCoreRequest

    config = EngineArgs(model=str(_tiny_llama(tmp_path / "m")), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=256, num_kv_blocks=64, **TP2).create_engine_config()
    core = EngineCore(config, prepare_engine_config(config))
    pids = [p.pid for p in core.model_executor.workers]
    try:
        core.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0,
                                                                          ignore_eos=True), None, 0.0))
        assert core.step(), "the first step produced nothing"
        # read at each step: the first ran under the default, every step from here on is meant to time out,
        # so the test waits 2 s for it rather than a limit a working step on a loaded machine must also meet
        monkeypatch.setenv("PAGODA_EXECUTE_MODEL_TIMEOUT_SECONDS", "2")
        os.kill(pids[1], signal.SIGSTOP)  # alive but silent: no sentinel fires, only the timeout can tell
        started = time.monotonic()
        with pytest.raises(ExecutorFailedError, match=r"did not answer execute_model within 2 s \(hung\)"):
            while core.has_work():
                core.step()
        assert time.monotonic() - started < 60
        with pytest.raises(ExecutorFailedError, match="hung"):
            core.check_health()
    finally:
        core.shutdown()
    assert not any(_alive(p) for p in pids), "a hung worker outlived the engine's shutdown"


def test_workers_exit_when_the_engine_process_dies(tmp_path: Path) -> None:
    model = _tiny_llama(tmp_path / "m")
    script = textwrap.dedent(f"""
        import os
        from pagoda import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(model)!r}, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      num_kv_blocks=64, tensor_parallel_size=2, distributed_executor_backend="mp")
            ex = llm.llm_engine.engine_core.core.model_executor
            print("PIDS", *[p.pid for p in ex.workers], flush=True)
            os._exit(0)  # no shutdown, no atexit: only the death pipe can stop the workers
    """)
    (tmp_path / "engine.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "engine.py")], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PIDS")), None)
    assert line is not None, out.stderr[-3000:]
    pids = [int(p) for p in line.split()[1:]]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "worker processes outlived their engine"


def test_server_health_503_when_a_tp_worker_dies(tmp_path: Path, start_server: Any) -> None:
    """`pagoda serve --tensor-parallel-size 2`: SIGKILL rank 1 mid-stream; the stream ends with an error event,
    /health is 503, and stopping the server leaves no worker behind."""
    import re

    import httpx

    from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

    model = _tiny_llama(tmp_path / "m")
    save_tiny_tokenizer(model, 128)
    server = start_server([str(model), "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256"])
    found = re.search(r"mp executor: 2 worker processes \(pids \[(\d+), (\d+)\]\)", server.output())
    assert found, server.output()
    pids = [int(found.group(1)), int(found.group(2))]
    body = {"prompt": "w5 w6 w7", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in head)
        os.kill(pids[1], signal.SIGKILL)
        rest = list(lines)
    errors = [line for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and "rank 1" in errors[0], rest[-5:]
    # a server whose engine died exits (vLLM's rule, within ENGINE_WATCH_INTERVAL + uvicorn's drain): until it
    # has, /health answers 503 naming the rank; once it has, its log does, and its exit status is an error
    try:
        health = httpx.get(server.url + "/health", timeout=30)
    except httpx.ConnectError:
        assert server.proc.wait(timeout=30) not in (0, None)
        assert re.search(r"rank 1.*the server exits so that its supervisor can restart it", server.output())
    else:
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    server.stop()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_torchrun_external_launcher_tp2_equals_transformers(tmp_path: Path) -> None:
    """torchrun starts two engines, one rank each (vLLM's external_launcher); both produce transformers' tokens."""
    import json

    import torch

    from pagoda.distributed import get_open_port

    cfg = transformers.LlamaConfig(**SMALL, vocab_size=128, num_attention_heads=4, num_key_value_heads=2)
    hf_model = build_tiny_model(cfg, seed=6)
    from pagoda.testing.model_parity import save_tiny_model

    model = save_tiny_model(hf_model, tmp_path / "m")
    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 50))]
    script = tmp_path / "spmd.py"
    script.write_text(textwrap.dedent(f"""
        import json, os
        from pagoda import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  tensor_parallel_size=2, distributed_executor_backend="external_launcher")
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        # a file per rank: both ranks share torchrun's stdout, where their lines can interleave
        with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump([list(o.outputs[0].token_ids) for o in outs], f)
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(get_open_port()), str(script)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(gen[0, len(p):].tolist())
    assert results[0] == results[1] == expected


def test_external_launcher_without_torchrun_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda import LLM

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        LLM(model=str(_tiny_llama(tmp_path / "m")), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
            num_kv_blocks=64, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
