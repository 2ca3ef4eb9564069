"""Speculative decoding against plain decoding, alternating in one process (the machine's speed drifts).

    python -m benchmarks.spec_decode [--alternations 3] [--max-tokens 128] [--method ngram] [--k 4]

One engine without speculation, one with ``speculative_config``; each alternation runs both on the same
prompts (greedy, ignore_eos): ``repetitive`` (a pattern the model continues, where n-gram lookups hit),
``free`` (prose, where they rarely do: the overhead when speculation does not pay) and ``batch8`` (eight
repetitive prompts at once). Prints output tok/s per engine and workload (median over the alternations),
the speed-up, and the drafts' acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagoda import LLM, SamplingParams

REPETITIVE = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,"
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = {"repetitive": [REPETITIVE], "free": [FREE],
             "batch8": [f"{REPETITIVE} (list {i})" for i in range(8)]}


def _tok_s(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alternations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    extra: dict[str, Any] = {"model": args.model} if args.model else {}
    spec_config: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        spec_config |= {"prompt_lookup_min": 2, "prompt_lookup_max": 3}
    engines = {"plain": LLM(max_model_len=1024, max_num_seqs=8, **extra),
               "spec": LLM(max_model_len=1024, max_num_seqs=8, speculative_config=spec_config, **extra)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels, graphs, lazy tables
        llm.generate(REPETITIVE, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    results: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in WORKLOADS}
    acceptance: dict[str, dict[str, int]] = {}
    for _ in range(args.alternations):
        for workload, prompts in WORKLOADS.items():
            for name, llm in engines.items():
                results[workload][name].append(_tok_s(llm, prompts, params))
                if name == "spec":
                    stats = llm.llm_engine.engine_core.core.make_stats().spec_decoding_stats
                    seen = acceptance.setdefault(workload, {"drafts": 0, "draft_tokens": 0, "accepted": 0})
                    if stats is not None:
                        seen["drafts"] += stats.num_drafts
                        seen["draft_tokens"] += stats.num_draft_tokens
                        seen["accepted"] += stats.num_accepted_tokens
    report = {}
    for workload, by_engine in results.items():
        plain, spec = (statistics.median(by_engine[e]) for e in ("plain", "spec"))
        a = acceptance.get(workload, {})
        report[workload] = {"plain_tok_s": round(plain, 1), "spec_tok_s": round(spec, 1),
                            "speedup": round(spec / plain, 2), **a,
                            "mean_acceptance_length": round(1 + a["accepted"] / a["drafts"], 2) if a.get("drafts") else None}
    print(json.dumps({"method": args.method, "k": args.k, "max_tokens": args.max_tokens, "results": report}, indent=1))


if __name__ == "__main__":
    main()
