"""W3 with the engine core in a thread of the API server vs in its own process (and DP replicas), interleaved.

    python -m benchmarks.engine_process --rounds 2 [--variants thread,process,dp2] [--dtype bfloat16]

Each round starts `pagoda serve` once per variant, in turn (thread, process, ...), warms it with two
short requests, runs W3 (128 streaming requests, 32 concurrent, 128 prompt tokens -> 64 output tokens,
greedy, ignore_eos) and stops it; the load average is printed before each run. The variants differ only
in the environment (PAGODA_ENABLE_V1_MULTIPROCESSING) or --data-parallel-size, so the ratios of one round
compare like with like on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.peers import _free_port, _wait_healthy

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "thread": ({"PAGODA_ENABLE_V1_MULTIPROCESSING": "0"}, []),
    "process": ({"PAGODA_ENABLE_V1_MULTIPROCESSING": "1"}, []),
    # two replicas on a 2-core machine: each core process gets one torch thread
    "dp2": ({"PAGODA_CPU_THREADS": "1"}, ["--data-parallel-size", "2"]),
}


def _run_one(variant: str, dtype: str, vocab: int) -> dict[str, Any]:
    from pagoda.benchmarks.datasets import random_requests
    from pagoda.benchmarks.serve import run_serve
    from pagoda.benchmarks.startup import stop_process

    extra_env, extra_args = VARIANTS[variant]
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--dtype", dtype, "--max-model-len", "2048",
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log = tempfile.NamedTemporaryFile(prefix=f"pagoda-engine-process-{variant}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env={**os.environ, **extra_env}, stdout=log, stderr=log)
    try:
        startup = _wait_healthy(base_url, proc, 600)
        run_serve(base_url, "bench", random_requests(2, 16, 4, vocab, seed=1), max_concurrency=2)
        load = os.getloadavg()
        result = run_serve(base_url, "bench", random_requests(128, 128, 64, vocab), max_concurrency=32)
        result["startup_s"] = startup
        result["loadavg_before"] = load
        return result
    except Exception as exc:  # noqa: BLE001 - one failed variant is reported, the others still run
        log.flush()
        return {"error": f"{type(exc).__name__}: {exc}", "log": Path(log.name).read_text(errors="replace")[-1500:]}
    finally:
        stop_process(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="thread,process")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for variant in variants:
            res = _run_one(variant, args.dtype, args.vocab)
            rows.append({"round": rnd, "variant": variant, **res})
            if "error" in res:
                print(f"round {rnd} {variant}: ERROR {res['error']}\n{res.get('log', '')}", flush=True)
                continue
            la = res["loadavg_before"]
            ttft, tpot = res["ttft_s"], res["tpot_s"]
            print(f"round {rnd} {variant:8s} output tok/s {res['output_tokens_per_s']:7.1f}  failed {res['failed']}  "
                  f"TTFT p50/p99 {ttft['p50']:.2f}/{ttft['p99']:.2f} s  TPOT p50 {tpot['p50'] * 1000:.1f} ms  "
                  f"load {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
