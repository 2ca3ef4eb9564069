"""`pagoda bench`: each subcommand runs end to end on a tiny model and reports what it measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from pagoda.benchmarks.datasets import random_requests
from pagoda.benchmarks.serve import run_serve
from pagoda.entrypoints.cli.main import app


def _bench(args: list[str], out: Path) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["bench", *args, "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_throughput_and_latency(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir, _ = tiny_model_dir("llama")
    common = ["--model", str(model_dir), "--skip-tokenizer-init", "--max-model-len", "256"]
    tp = _bench(["throughput", *common, "--num-prompts", "6", "--input-len", "20", "--output-len", "7"], tmp_path / "t.json")
    assert tp["num_requests"] == 6 and tp["output_tokens"] == 42  # ignore_eos: every request runs to its length
    assert tp["output_tokens_per_s"] > 0
    shared = _bench(["throughput", *common, "--num-prompts", "4", "--input-len", "8", "--prefix-len", "32",
                     "--output-len", "2"], tmp_path / "p.json")
    assert shared["output_tokens"] == 8
    lat = _bench(["latency", *common, "--batch-size", "2", "--input-len", "16", "--output-len", "5",
                  "--num-iters", "1", "--num-iters-warmup", "0"], tmp_path / "l.json")
    assert lat["decode_tokens_per_s_per_sequence"] > 0 and lat["ttft_s"]["p50"] > 0


def test_serve_bench_against_a_running_server(default_model_server: Any) -> None:
    import httpx

    server = default_model_server
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    result = run_serve(server.url, model, random_requests(6, 12, 5, vocab_size=2000), max_concurrency=3)
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["ttft_s"]["p50"] > 0 and result["e2e_s"]["p99"] >= result["ttft_s"]["p99"]
    assert result["output_tokens_per_s"] > 0
    bad = run_serve(server.url, "no-such-model", random_requests(2, 4, 2, vocab_size=2000))
    assert bad["failed"] == 2 and bad["errors"][0].startswith("HTTP 404")
