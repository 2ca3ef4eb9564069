"""Issue 39's measurements: an ordinary request's latency beside hostile input, and the engine core's RSS
after many unique JSON schemas.

    python -m benchmarks.hostile_input [--schemas 1000] [--workers 4]

Starts `pagoda serve` (default model, --max-model-len 512) on a free port. Latencies are medians of an
ordinary completion (4 greedy tokens) repeated back to back: alone, then while one client sends 10 MB
prompts, then while one sends 10,000-property schemas; /health's worst answer time beside each. Then it
sends ``--schemas`` completions, each with a schema no other had (so each compiles and enters the grammar
cache), and reads the engine-core process's RSS (/proc) before, during and after.
``--structured-outputs-config`` is passed to the server as it is.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ORDINARY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ordinary_beside(url: str, hostile: dict[str, Any] | None, seconds: float) -> tuple[float, float, int]:
    """-> (median ordinary latency, worst /health, hostile requests sent)."""
    stop = threading.Event()
    sent = [0]
    worst = [0.0]

    def attack() -> None:
        with httpx.Client(timeout=300) as client:
            while hostile is not None and not stop.is_set():
                client.post(url + "/v1/completions", json=hostile)
                sent[0] += 1

    def health() -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                t = time.perf_counter()
                client.get(url + "/health")
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.1)

    threads = [threading.Thread(target=attack), threading.Thread(target=health)]
    for t in threads:
        t.start()
    samples = []
    end = time.monotonic() + seconds
    with httpx.Client(timeout=300) as client:
        while time.monotonic() < end:
            t = time.perf_counter()
            assert client.post(url + "/v1/completions", json=ORDINARY).status_code == 200
            samples.append(time.perf_counter() - t)
    stop.set()
    for t in threads:
        t.join()
    return statistics.median(samples), worst[0], sent[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemas", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--structured-outputs-config", default="",
                        help="the server's --structured-outputs-config (JSON); e.g. "
                             "'{\"max_schema_properties\": 0, \"max_schema_nodes\": 0}' lets the 10,000-property "
                             "schema reach the compiler, so that compile_timeout / compile_memory_bytes stop it")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    extra = ["--structured-outputs-config", args.structured_outputs_config] if args.structured_outputs_config else []
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--max-model-len", "512",
                             "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        core = int(Path(log.name).read_text().split("engine core 0 runs in process ", 1)[1].split()[0])
        # warm the structured-outputs backend so its load does not count as a schema's
        httpx.post(url + "/v1/completions", json={**ORDINARY, "structured_outputs": {"json": {"type": "integer"}}},
                   timeout=300)
        big_prompt = {"prompt": "hello " * 1_750_000, "max_tokens": 2}
        big_schema = {**ORDINARY, "structured_outputs": {"json": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(10_000)}}}}
        rows = []
        for name, hostile in (("alone", None), ("beside 10 MB prompts", big_prompt),
                              ("beside 10,000-property schemas", big_schema), ("alone again", None)):
            median, worst, sent = _ordinary_beside(url, hostile, args.seconds)
            rows.append((name, median, worst, sent))
            print(f"{name:32s} ordinary median {median * 1000:7.1f} ms  worst /health {worst * 1000:7.1f} ms  "
                  f"hostile requests {sent}", flush=True)
        before = _rss_mib(core)

        def unique(i: int) -> int:
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"type": "string"}},
                      "required": [f"k{i}"]}
            return httpx.post(url + "/v1/completions", json={**ORDINARY, "max_tokens": 2,
                                                             "structured_outputs": {"json": schema}},
                              timeout=300).status_code

        started = time.perf_counter()
        peak = before
        with ThreadPoolExecutor(args.workers) as pool:
            for n, status in enumerate(pool.map(unique, range(args.schemas)), 1):
                assert status == 200, status
                if n % 100 == 0:
                    peak = max(peak, _rss_mib(core))
                    print(f"  {n} unique schemas: engine core RSS {_rss_mib(core):.0f} MiB", flush=True)
        after = _rss_mib(core)
        print(json.dumps({"ordinary": [{"case": r[0], "median_ms": round(r[1] * 1000, 1),
                                        "worst_health_ms": round(r[2] * 1000, 1), "hostile_sent": r[3]} for r in rows],
                          "schemas": args.schemas, "seconds": round(time.perf_counter() - started, 1),
                          "core_rss_mib": {"before": round(before), "peak": round(peak), "after": round(after)}}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
