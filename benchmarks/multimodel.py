"""Many models on one port: load on first request, reload after unload, wake from park, RSS, two models
together vs alone.

    python -m benchmarks.multimodel [--requests 16] [--max-tokens 32]

One `pagoda serve --models-config --max-loaded-models 2` with the default model (SmolLM2-135M-Instruct) three
times, as `smol-a`, `smol-b` and `smol-c` (each its own engine and core process). In order: the first request
to `smol-a` (its load), the first to `smol-b` (a second model loaded on its first request), the server's RSS
(the API process and its children) with both loaded, `POST /v1/models/unload smol-a` (a real unload) and the
RSS after it, the next request to `smol-a` (a reload after unload), then greedy output throughput of
`--requests` concurrent requests to `smol-a` alone, `smol-b` alone, and both at once (half each). Then the
first request to `smol-c`, which evicts the least recently used of the two (parked at sleep level 1 where the
pool parks, unloaded where it does not), the RSS after it and the next request to the evicted one (a wake, or a
reload); and a request to `smol-c` with `keep_alive: 0` (parked at level 2, or unloaded), the RSS and the
next request to it. Each eviction's `state` (from /v1/models) is printed with its timing. The load average
is printed with the numbers: on a shared machine only the ratios of one run compare.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers import _free_port, _wait_healthy

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _rss_bytes(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _complete(url: str, model: str, max_tokens: int, **extra: Any) -> int:
    import httpx

    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, **extra}, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def _timed(url: str, model: str, max_tokens: int) -> float:
    start = time.perf_counter()
    _complete(url, model, max_tokens)
    return time.perf_counter() - start


def _state(url: str, model: str) -> str:
    import httpx

    cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return str(next(c["state"] for c in cards if c["id"] == model))


def _wait_state_not(url: str, model: str, state: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (now := _state(url, model)) == state and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def _throughput(url: str, models: list[str], requests: int, max_tokens: int) -> float:
    jobs = [models[i % len(models)] for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(lambda m: _complete(url, m, max_tokens), jobs))
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    import httpx
    import yaml

    from pagoda.benchmarks.startup import stop_process

    workdir = Path(tempfile.mkdtemp(prefix="pagoda-mm-bench-"))
    config = workdir / "models.yaml"
    common = {"max_model_len": 1024}
    config.write_text(yaml.safe_dump({"models": [{"model": str(_default_model()), "served_model_name": name, **common}
                                                 for name in ("smol-a", "smol-b", "smol-c")]}))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--models-config",
                             str(config), "--port", str(port), "--max-loaded-models", "2"], stdout=log, stderr=subprocess.STDOUT)
    results: dict[str, Any] = {"load_average_before": os.getloadavg()}
    try:
        _wait_healthy(url, proc, 300)
        results["rss_none_loaded_mib"] = _rss_bytes(proc.pid) / 2**20
        results["first_request_a_s"] = _timed(url, "smol-a", 1)
        results["first_request_b_s"] = _timed(url, "smol-b", 1)
        results["warm_request_b_s"] = _timed(url, "smol-b", 1)
        time.sleep(1.0)
        results["rss_both_loaded_mib"] = _rss_bytes(proc.pid) / 2**20
        httpx.post(url + "/v1/models/unload", json={"model": "smol-a"}, timeout=120).raise_for_status()
        time.sleep(1.0)
        results["rss_after_evicting_a_mib"] = _rss_bytes(proc.pid) / 2**20
        results["reload_request_a_s"] = _timed(url, "smol-a", 1)
        for name, models in (("a_alone", ["smol-a"]), ("b_alone", ["smol-b"]), ("both", ["smol-a", "smol-b"])):
            _throughput(url, models, 2, 4)  # warm
            results[f"tok_s_{name}"] = _throughput(url, models, args.requests, args.max_tokens)
        results["both_vs_mean_alone"] = results["tok_s_both"] / ((results["tok_s_a_alone"] + results["tok_s_b_alone"]) / 2)
        results["first_request_c_s"] = _timed(url, "smol-c", 1)
        evicted = next(m for m in ("smol-a", "smol-b") if _state(url, m) != "loaded")
        results["evicted_by_c"], results["evicted_state"] = evicted, _state(url, evicted)
        time.sleep(1.0)
        results["rss_after_evicting_for_c_mib"] = _rss_bytes(proc.pid) / 2**20
        results["request_after_eviction_s"] = _timed(url, evicted, 1)
        _complete(url, "smol-c", 1, keep_alive=0)
        results["keep_alive_0_state"] = _wait_state_not(url, "smol-c", "loaded")
        time.sleep(1.0)
        results["rss_after_keep_alive_0_mib"] = _rss_bytes(proc.pid) / 2**20
        results["request_after_keep_alive_0_s"] = _timed(url, "smol-c", 1)
        results["load_average_after"] = os.getloadavg()
    finally:
        stop_process(proc)
        log.close()
    print(json.dumps(results, indent=2))


def _default_model() -> Path:
    from pagoda.model_loader.source import default_model_path

    return default_model_path()


if __name__ == "__main__":
    main()
