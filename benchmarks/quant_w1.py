"""W1 (offline, 64 x 128 -> 128, greedy, EOS ignored) on the shipped SmolLM2 Q4_1 GGUF file, kept in
blocks (the gguf method) beside the same file dequantized at load, and CPU kernel graphs on and off.

usage: python -m benchmarks.quant_w1 [--rounds 1] [--threads 2] [--configs gguf-bf16,dequant-bf16,...]

Every configuration runs in its own process (round-robin over the rounds, so load changes hit all
alike) and reports output tok/s, elapsed seconds and its resident memory after loading. Prints one
JSON line per run and a median table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks._rounds import alternate

CONFIGS = {
    # name: (quantization, dtype, enforce_eager)
    "gguf-bf16": (None, "bfloat16", False),
    "gguf-fp32": (None, "float32", False),
    "dequant-bf16": ("none", "bfloat16", False),
    "dequant-fp32": ("none", "float32", False),
    "gguf-bf16-eager": (None, "bfloat16", True),
}
NUM, INPUT_LEN, OUTPUT_LEN = 64, 128, 128


def run_one(name: str, threads: int) -> dict:
    os.environ.setdefault("PAGODA_CPU_THREADS", str(threads))
    from pagoda import LLM
    from pagoda.benchmarks.datasets import random_requests
    from pagoda.benchmarks.throughput import run_throughput

    quantization, dtype, eager = CONFIGS[name]
    llm = LLM(model=None, quantization=quantization, dtype=dtype, max_model_len=INPUT_LEN + OUTPUT_LEN + 16,
              enforce_eager=eager)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    result = run_throughput(llm, random_requests(NUM, INPUT_LEN, OUTPUT_LEN, llm.llm_engine.vocab_size), use_tqdm=False)
    return {"config": name, "rss_mib": rss, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.threads)))
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    runs = alternate("benchmarks.quant_w1", names, args.rounds, ["--threads", str(args.threads)])
    print("| config | output tok/s (median; runs) | RSS after load MiB |")
    print("|---|---|---|")
    for name, rs in runs.items():
        rates = [x["output_tokens_per_s"] for x in rs]
        print(f"| {name} | {statistics.median(rates):.1f} ({', '.join(f'{x:.1f}' for x in rates)}) | "
              f"{statistics.median(x['rss_mib'] for x in rs):.0f} |")


if __name__ == "__main__":
    main()
