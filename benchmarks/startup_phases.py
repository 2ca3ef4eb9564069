"""`pagoda serve` start-up by phase, from the server's own log, for one or more source trees interleaved.

    python -m benchmarks.startup_phases --rounds 3 --mode warm before=/path/to/old/tree after=.
    python -m benchmarks.startup_phases --rounds 1 --mode fresh after=.

Each run launches ``pagoda serve`` (the embedded default model, the real defaults: the KV cache
prefault on) with ``PYTHONPATH`` at the tree's source folders, polls ``/health``, streams one 4-token
completion (first token) and reads the resident memory of the server's processes at ``/health``.
``warm``: each tree has its own cache root (``PAGODA_CACHE_ROOT``), filled by a first run that is not
reported; ``fresh``: a new empty cache root every run (every kernel library compiled, every GGUF
conversion made again). Trees alternate order every round, since the machine is shared.

A phase ends at a log line: the API process's imports (platform selected), its config (the start-up
block of resolved values), the tokenizer with the engine core's spawn and whatever of its imports is not
done by then (its thread count line; a standby core spawned first thing has done most), the weights
(loaded ... in), the attention backend, the KV cache (memory: ...) and the graphs (the graph runner's
line), then /health. The notes carry the engine core's own import time (a standby core's runs beside
the API phases).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

CORE = "[engine core 0]"
# (phase, the log line that ends it, whose process it is in)
MARKS = [
    ("API imports", r"pagoda\.platforms: platform \w+ selected", "api"),
    ("API config", r"pagoda\.engine\.config_resolution: engine config \(platform", "api"),  # its start-up block
    # the tokenizer, the core's spawn and the imports it has not done by then (all of them before the standby core)
    ("engine-core spawn + imports (not overlapped)", r"pagoda_platform_cpu\.platform: CPU platform: \d+ torch threads",
     "core"),
    ("load weights (+ build waits)", r"pagoda\.worker\.model_runner: loaded ", "core"),
    ("attention backend (+ build wait)", r"pagoda_attn_cpu\.backend: cpu_paged attention", "core"),
    ("activation profile + KV cache + prefault", r"pagoda\.worker\.model_runner: memory: ", "core"),
    ("decode graphs", r"pagoda\.worker\.graphs: ", "core"),
]
NOTES = r"compiled in|loaded \(built by|faulted in|captured|memory: |imports took|spawned as process"


def pythonpath(root: str) -> str:
    """As /work/devenv.sh: every source folder of the tree, then the tree."""
    parts = glob.glob(f"{root}/core/src") + glob.glob(f"{root}/kernels/src") + glob.glob(f"{root}/platform_*/src")
    return ":".join(sorted(parts + glob.glob(f"{root}/plugins/*/src")) + [root])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += int(f.read().split("VmRSS:")[1].split()[0]) * 1024
        except (OSError, IndexError, ValueError):
            pass
    return total


def phases(lines: list[tuple[float, str]], healthy: float | None) -> dict[str, float]:
    out: dict[str, float] = {}
    prev = 0.0
    for name, rx, where in MARKS:
        hit = next((t for t, line in lines if t >= prev and (CORE in line) == (where == "core") and re.search(rx, line)),
                   None)
        if hit is not None:
            out[name] = round(hit - prev, 2)
            prev = hit
    if healthy is not None:
        out["to /health"] = round(healthy - prev, 2)
    return out


def run(root: str, cache_root: str, timeout: float = 600.0, log: str | None = None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=pythonpath(root), PAGODA_CACHE_ROOT=cache_root, PYTHONUNBUFFERED="1")
    env.pop("PAGODA_CPU_KVCACHE_PREFAULT", None)  # the real default: prefault on
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    healthy = first_token = None
    rss = 0
    try:
        while time.perf_counter() - start < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.02)
        if healthy is not None:
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False)
            rss = resident_bytes([proc.pid, *map(int, children.stdout.split())])
            with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
                model = json.load(r)["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
            request = urllib.request.Request(base + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=timeout) as r:
                for raw in r:
                    if raw.startswith(b"data:") and b'"text"' in raw:
                        first_token = time.perf_counter() - start
                        break
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    if log is not None:
        with open(log, "w") as f:
            f.writelines(f"{t:8.2f} {line}\n" for t, line in lines)
    return {
        "healthy_s": healthy and round(healthy, 2), "first_token_s": first_token and round(first_token, 2),
        "rss_mib": rss >> 20, "load_avg": round(os.getloadavg()[0], 1), "phases": phases(lines, healthy),
        "notes": [line[line.find("pagoda"):][:160] for _, line in lines if re.search(NOTES, line)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="LABEL=PATH of a source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("warm", "fresh"), default="warm")
    parser.add_argument("--cache-dir", default="/tmp/pagoda-startup-phases", help="where the cache roots and logs go")
    args = parser.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.trees]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
    os.makedirs(args.cache_dir, exist_ok=True)
    if args.mode == "warm":
        for label, root in trees:  # fill each tree's caches once
            run(root, f"{args.cache_dir}/{label}-warm")
    for i in range(args.rounds):
        for label, root in trees if i % 2 == 0 else trees[::-1]:
            cache = f"{args.cache_dir}/{label}-warm" if args.mode == "warm" else f"{args.cache_dir}/{label}-fresh-{time.time_ns()}"
            result = run(root, cache, log=f"{args.cache_dir}/{label}-{args.mode}-{i}.log")
            results[label].append(result)
            print(label, args.mode, json.dumps(result), flush=True)
    for label, rs in results.items():
        healthy = [r["healthy_s"] for r in rs if r["healthy_s"]]
        if healthy:
            print(f"{label} {args.mode}: /health min {min(healthy):.2f} s, median {statistics.median(healthy):.2f} s "
                  f"over {len(healthy)} runs")


if __name__ == "__main__":
    main()
