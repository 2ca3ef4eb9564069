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


def test_serve_bench_burst_mode_reports_each_round(default_model_server: Any, tmp_path: Path) -> None:
    server = default_model_server
    result = _bench(["serve", "--base-url", server.url, "--burst", "3", "--num-rounds", "2", "--random-input-len", "12",
                     "--random-output-len", "4", "--random-vocab-size", "2000"], tmp_path / "b.json")
    assert (result["burst"], result["num_rounds"], result["completed"], result["failed"]) == (3, 2, 6, 0)
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        assert r["completed"] == 3 and r["output_tokens"] == 12  # ignore_eos: 3 requests x 4 tokens
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]
        assert r["tpot_s"]["p50"] > 0 and r["output_tokens_per_s"] > 0
    # the rounds run one after another: the total time is their sum
    assert abs(result["elapsed_s"] - sum(r["elapsed_s"] for r in result["rounds"])) < 1e-9


def test_serve_bench_refuses_options_burst_mode_cannot_honour() -> None:
    runner = CliRunner()
    for extra in (["--max-concurrency", "4"], ["--request-rate", "2"], ["--burstiness", "0.5"],
                  ["--num-prompts", "7"], ["--num-rounds", "0"]):
        result = runner.invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--burst", "4", *extra])
        assert result.exit_code == 2, (extra, result.output)
    result = runner.invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-rounds", "2"])
    assert result.exit_code == 2 and "--num-rounds needs --burst" in result.output


def test_arrival_gaps_follow_rate_and_burstiness() -> None:
    import random
    import statistics

    from pagoda.benchmarks.serve import _gap

    rng = random.Random(0)
    for burstiness in (1.0, 0.25):
        gaps = [_gap(rng, 4.0, burstiness) for _ in range(20000)]
        assert abs(statistics.fmean(gaps) - 0.25) < 0.02  # the mean gap is 1 / rate whatever the shape
        # variance of gamma(k, 1 / (rate k)) is 1 / (rate^2 k): burstier arrivals spread wider
        assert abs(statistics.pvariance(gaps) - 1 / (16 * burstiness)) < 0.1 / burstiness
    assert _gap(rng, float("inf"), 1.0) == 0.0


def test_grounded_workload_with_speculation(tmp_path: Path) -> None:
    """The input-grounded workload on the default model (a real tokenizer), with n-gram speculation: the
    answers copy the passage, so drafts are accepted."""
    common = ["--max-model-len", "1024", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}']
    tp = _bench(["throughput", *common, "--dataset-name", "grounded", "--num-prompts", "3", "--input-len", "150",
                 "--output-len", "24"], tmp_path / "g.json")
    assert tp["num_requests"] == 3 and tp["output_tokens"] == 72
    lat = _bench(["latency", *common, "--dataset-name", "grounded", "--batch-size", "1", "--input-len", "150",
                  "--output-len", "16", "--num-iters", "1", "--num-iters-warmup", "0"], tmp_path / "gl.json")
    assert lat["decode_tokens_per_s_per_sequence"] > 0


def test_grounded_requests_hold_their_passage() -> None:
    from pagoda.benchmarks.datasets import grounded_requests
    from pagoda.model_loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(None))
    reqs = grounded_requests(6, 200, 32, tok, seed=3)
    texts = [tok.decode(r.prompt_token_ids) for r in reqs]
    assert [t.split("\n")[0].split()[0] for t in texts[:3]] == ["Repeat", "Summarise", "Rewrite"]
    assert all(200 <= r.prompt_len <= 320 and r.output_len == 32 for r in reqs)
    assert len(set(texts)) == 6  # a different passage each
    assert grounded_requests(6, 200, 32, tok, seed=3) == reqs  # fixed by the seed
