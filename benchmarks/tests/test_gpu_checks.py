"""The GPU-measurement script runs end to end on CPU in its --tiny form, so it is ready for a GPU session."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_checks import main


def test_tiny_run_reports_greedy_equality_and_three_throughputs(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert main(["--tiny", "--work-dir", str(tmp_path / "work"), "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tiny"] is True and report["device"]
    greedy = report["greedy"]
    # float32, same weights, same prompts: pagoda's greedy tokens are transformers' exactly
    assert greedy["identical"] == greedy["prompts"] == 3
    throughput = report["throughput"]
    for name in ("pagoda", "pagoda_enforce_eager", "transformers"):
        assert throughput[name]["output_tokens_per_s"] > 0
    assert throughput["pagoda_vs_transformers"] > 0
