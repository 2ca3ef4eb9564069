"""A burst's first tokens in the engine's own CPU time: TTFT p50 / p99, TPOT, ITL p99 of simultaneous requests.

    python -m benchmarks.burst_schedule --model DIR [--burst 32] [--input-len 128] [--output-len 64]
        [--rounds 4] [--max-num-batched-tokens N] [--clock cpu|wall]

One process, one engine (``LLMEngine``, no server), rounds of ``--burst`` random prompts added at
once and stepped to the end; each request's token times are read after every step. The default
clock is the process's CPU time (``time.process_time``) with one torch thread
(``PAGODA_CPU_THREADS=1`` is set when unset): on a shared 2-vCPU machine at load 10-20 wall-clock
TTFTs of the same burst swung 18-34 s, while CPU time stays within a few percent, so scheduling
policies can be compared by running this once per revision (each from its own worktree) in turn.
CPU time counts only this process's work, so it says nothing about waiting on the machine and
``--clock wall`` is the one to quote as latency.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="an HF directory (benchmarks.export writes the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    if args.burst < 1 or args.input_len < 1 or args.output_len < 2 or args.rounds < 1:
        parser.error("--burst, --input-len and --rounds must be positive and --output-len at least 2")
    os.environ.setdefault("PAGODA_CPU_THREADS", "1")  # before the engine exists: its threads are set at start

    from pagoda import SamplingParams
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # every round's prompts are new anyway; no cross-round hits
    ))
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    print(f"burst {args.burst} x {args.input_len} -> {args.output_len}, clock {args.clock}, "
          f"PAGODA_CPU_THREADS={os.environ['PAGODA_CPU_THREADS']}")
    for r in range(-1, args.rounds):  # round -1 warms up and is not reported
        ids = [f"{r}-{i}" for i in range(args.burst)]
        start = clock()
        for rid in ids:
            prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = clock() - start
            for out in outputs:
                seen = times[out.request_id]
                n = len(out.outputs[0].token_ids) if out.outputs else 0  # cumulative outputs
                seen.extend([now] * (n - len(seen)))
        if r < 0:
            continue
        ttft = np.array([times[rid][0] for rid in ids])
        itl = np.concatenate([np.diff(times[rid]) for rid in ids])
        tpot = np.array([(times[rid][-1] - times[rid][0]) / (len(times[rid]) - 1) for rid in ids])
        e2e = np.array([times[rid][-1] for rid in ids])
        print(f"round {r}: TTFT p50 {np.percentile(ttft, 50):.3f} p99 {np.percentile(ttft, 99):.3f} s, "
              f"TPOT p50 {np.median(tpot) * 1e3:.1f} ms, ITL p99 {np.percentile(itl, 99) * 1e3:.0f} ms, "
              f"E2E mean {e2e.mean():.3f} s, round {clock() - start:.3f} s, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
