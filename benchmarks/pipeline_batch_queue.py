"""Pipeline parallelism: throughput with one vs several micro-batches in flight, on one engine.

    python -m benchmarks.pipeline_batch_queue --rounds 4
    python -m benchmarks.pipeline_batch_queue --hidden 512 --layers 8 --rounds 4

One ``pipeline_parallel_size=--pp`` engine (mp executor, one worker process per stage) serves the same
workload with ``batch_queue_size`` 1 (the stages take turns on one batch) and ``--pp`` (a batch per
stage in flight), alternating within each round (1, N, N, 1, ...) so both see the same machine. A
workload: ``--seqs`` concurrent greedy requests of ``--prompt`` random tokens, ``--decode`` tokens each;
throughput is output tokens over the wall time from the first request added to the last finished.
"Overlap" is the share of steps whose stage 1 started before the last stage finished the step before it
(workers' step times). The load average is read before each run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _tiny_model(path: Path, hidden: int, layers: int) -> str:
    import transformers

    from pagoda.testing.model_parity import build_tiny_model, save_tiny_model

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   vocab_size=512, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024)
    return str(save_tiny_model(build_tiny_model(cfg), path))


def _engine(model: str, pp: int) -> Any:
    from pagoda.config import EngineArgs
    from pagoda.engine.core import EngineCore, prepare_engine_config

    config = EngineArgs(model=model, pipeline_parallel_size=pp, distributed_executor_backend="mp", dtype="float32",
                        max_model_len=512, num_kv_blocks=512, skip_tokenizer_init=True,
                        # both settings run the same prompts: no prefix cache, or the second run of a round skips
                        # its prefill
                        enable_prefix_caching=False).create_engine_config()
    return EngineCore(config, prepare_engine_config(config))


def _run(core: Any, seqs: int, prompt: int, decode: int, seed: int) -> dict[str, float]:
    from pagoda import SamplingParams
    from pagoda.scheduler.request import Request

    rng = random.Random(seed)
    vocab = int(core.config.resolved.vocab_size)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    core.model_executor.collective_rpc("get_step_times")  # forget earlier steps
    start = time.perf_counter()
    for i in range(seqs):
        core.add_request(Request(f"s{seed}-{i}", [rng.randrange(vocab) for _ in range(prompt)], params, None,
                                 core.block_size))
    tokens = 0
    while core.has_work():
        tokens += sum(len(out.new_token_ids) for out in core.step())
    elapsed = time.perf_counter() - start
    times = core.model_executor.collective_rpc("get_step_times")
    first, last = times[0], times[-1]
    overlaps = sum(1 for k in range(len(first) - 1) if first[k + 1][0] < last[k][1])
    return {"tok_s": tokens / elapsed, "steps": len(first), "overlap": overlaps / max(1, len(first) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--decode", type=int, default=64)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        core = _engine(_tiny_model(Path(tmp) / "m", a.hidden, a.layers), a.pp)
        try:
            _run(core, 4, 8, 4, seed=-1)  # warm-up (kernel builds, first-touch pages)
            print(f"PP={a.pp} mp, Llama hidden={a.hidden} layers={a.layers}, seqs={a.seqs} prompt={a.prompt} "
                  f"decode={a.decode}, float32, {os.cpu_count()} CPUs", flush=True)
            results: dict[int, list[float]] = {1: [], a.pp: []}
            for r in range(a.rounds):
                order = (1, a.pp) if r % 2 == 0 else (a.pp, 1)
                parts = []
                for size in order:
                    core.batch_queue_size = size
                    load = os.getloadavg()[0]
                    res = _run(core, a.seqs, a.prompt, a.decode, seed=r)
                    results[size].append(res["tok_s"])
                    parts.append(f"{size} in flight [load {load:.1f}]: {res['tok_s']:.1f} tok/s, {res['steps']} steps, "
                                 f"overlap {100 * res['overlap']:.0f}%")
                print(f"round {r}: " + " | ".join(parts), flush=True)
            one, many = statistics.median(results[1]), statistics.median(results[a.pp])
            ratios = [m / o for o, m in zip(results[1], results[a.pp])]
            print(f"median: 1 in flight {one:.1f} tok/s, {a.pp} in flight {many:.1f} tok/s; per-round ratio "
                  + ", ".join(f"{x:.2f}x" for x in ratios), flush=True)
        finally:
            core.shutdown()


if __name__ == "__main__":
    main()
