"""Start-up: from launching `pagoda serve` to the first token of the first request."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_startup(serve_args: list[str], timeout: float = 300.0, command: list[str] | None = None) -> dict[str, Any]:
    """Launch the server, poll /health, stream one completion; times in seconds from launch."""
    port = free_port()
    cmd = (command or [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve"]) + serve_args + [
        "--host", "127.0.0.1", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    healthy = first_token = None
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
                raise RuntimeError(f"server exited with {proc.returncode}: {err}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.05)
        if healthy is None:
            raise TimeoutError(f"server not healthy after {timeout}s")
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and '"text"' in line:
                    first_token = time.perf_counter() - start
                    break
    finally:
        stop_process(proc)
    return {"command": " ".join(cmd), "healthy_s": healthy, "first_token_s": first_token}


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if the server is still there after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
