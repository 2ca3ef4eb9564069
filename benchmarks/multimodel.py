"""Many models on one port: load on first request, reload after eviction, RSS, two models together vs alone.

    python -m benchmarks.multimodel [--requests 16] [--max-tokens 32]

One `pagoda serve --models-config` with the default model (SmolLM2-135M-Instruct) twice, as `smol-a` and
`smol-b` (two engines, each with its own core process). In order: the first request to `smol-a` (its
load), the first to `smol-b` (a second model loaded on its first request), the server's RSS (the API
process and its children) with both loaded, `POST /v1/models/unload smol-a` (the eviction path) and the
RSS after it, the next request to `smol-a` (a reload after eviction), then greedy output throughput of
`--requests` concurrent requests to `smol-a` alone, `smol-b` alone, and both at once (half each). The
load average is printed with the numbers: on a shared machine only the ratios of one run compare.
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


def _complete(url: str, model: str, max_tokens: int) -> int:
    import httpx

    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def _timed(url: str, model: str, max_tokens: int) -> float:
    start = time.perf_counter()
    _complete(url, model, max_tokens)
    return time.perf_counter() - start


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
    config.write_text(yaml.safe_dump({"models": [{"model": str(_default_model()), "served_model_name": "smol-a", **common},
                                                 {"model": str(_default_model()), "served_model_name": "smol-b", **common}]}))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--models-config",
                             str(config), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
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
