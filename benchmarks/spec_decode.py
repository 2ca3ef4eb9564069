"""Speculative decoding against plain decoding, alternating in one process (the machine's speed drifts).

    python -m benchmarks.spec_decode [--alternations 3] [--max-tokens 128] [--methods ngram,suffix] [--k 4]
        [--workloads repetitive,free,batch8,grounded]

One engine without speculation and one per method with ``speculative_config``; each alternation runs all
of them on the same prompts (greedy, ignore_eos): ``repetitive`` (a pattern the model continues, where
n-gram lookups hit), ``free`` (prose, where they rarely do: the overhead when speculation does not pay),
``batch8`` (eight repetitive prompts at once) and ``grounded`` (the input-grounded dataset of ``pagoda
bench --dataset-name grounded``: repeat / summarise / edit a passage, one request at a time: a single
stream). Prints output tok/s per engine and workload (median over the alternations), each method's
speed-up over plain, and the drafts' acceptance (mean acceptance length = 1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.datasets import grounded_requests

REPETITIVE = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,"
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = {"repetitive": [REPETITIVE], "free": [FREE],
             "batch8": [f"{REPETITIVE} (list {i})" for i in range(8)]}


Prompts = list[Any]


def _tok_s(llm: LLM, batches: list[Prompts], params: SamplingParams, cpu_time: bool) -> float:
    """Output tok/s over ``batches`` run one after the other (each one ``generate`` call); ``cpu_time``: per
    second of this process's CPU time instead of wall time (the engine core runs in this process)."""
    clock = time.process_time if cpu_time else time.perf_counter
    start, tokens = clock(), 0
    for prompts in batches:
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (clock() - start)


def _spec_config(method: str, k: int) -> dict[str, Any]:
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config |= {"prompt_lookup_min": 2, "prompt_lookup_max": 3}
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alternations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ngram", help="comma-separated proposers, each its own engine")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="repetitive,free,batch8")
    ap.add_argument("--grounded-prompts", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=300, help="grounded: the passage's length in tokens")
    ap.add_argument("--cpu-time", action="store_true",
                    help="tok/s per CPU second of this process, not per wall second: on a machine shared with "
                    "other work, with PAGODA_CPU_THREADS=1, what a quiet machine's wall clock would show, more nearly")
    args = ap.parse_args()
    extra: dict[str, Any] = {"model": args.model} if args.model else {}
    methods = [m for m in args.methods.split(",") if m]
    engines = {"plain": LLM(max_model_len=1024, max_num_seqs=8, **extra)}
    for method in methods:
        engines[method] = LLM(max_model_len=1024, max_num_seqs=8, speculative_config=_spec_config(method, args.k),
                              **extra)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    grounded = grounded_requests(args.grounded_prompts, args.input_len, args.max_tokens, engines["plain"].get_tokenizer())
    workloads: dict[str, list[Prompts]] = {name: [prompts] for name, prompts in WORKLOADS.items()}
    # a single stream: each request alone
    workloads["grounded"] = [[{"prompt_token_ids": r.prompt_token_ids}] for r in grounded]
    chosen = {w: workloads[w] for w in args.workloads.split(",") if w}
    for llm in engines.values():  # warm-up: kernels, graphs (each verify shape too), lazy tables
        llm.generate(REPETITIVE, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
        llm.llm_engine.engine_core.core.make_stats()  # drop the warm-up's counters
    results: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in chosen}
    acceptance: dict[str, dict[str, dict[str, int]]] = {w: {m: {"drafts": 0, "draft_tokens": 0, "accepted": 0}
                                                           for m in methods} for w in chosen}
    for _ in range(args.alternations):
        for workload, batches in chosen.items():
            for name, llm in engines.items():
                results[workload][name].append(_tok_s(llm, batches, params, args.cpu_time))
                if name != "plain":
                    stats = llm.llm_engine.engine_core.core.make_stats().spec_decoding_stats
                    seen = acceptance[workload][name]
                    if stats is not None:
                        seen["drafts"] += stats.num_drafts
                        seen["draft_tokens"] += stats.num_draft_tokens
                        seen["accepted"] += stats.num_accepted_tokens
    report: dict[str, Any] = {}
    for workload, by_engine in results.items():
        plain = statistics.median(by_engine["plain"])
        row: dict[str, Any] = {"plain_tok_s": round(plain, 1)}
        for method in methods:
            spec = statistics.median(by_engine[method])
            a = acceptance[workload][method]
            row[method] = {"tok_s": round(spec, 1), "speedup": round(spec / plain, 2),
                           # per alternation, against that alternation's plain run
                           "speedups": [round(s / p, 2) for s, p in zip(by_engine[method], by_engine["plain"])], **a,
                           "mean_acceptance_length": round(1 + a["accepted"] / a["drafts"], 2) if a["drafts"] else None}
        report[workload] = row
    print(json.dumps({"clock": "cpu" if args.cpu_time else "wall", "threads": torch.get_num_threads(),
                      "methods": methods, "k": args.k, "max_tokens": args.max_tokens, "results": report}, indent=1))


if __name__ == "__main__":
    main()
