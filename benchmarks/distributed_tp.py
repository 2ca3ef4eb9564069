"""Per-step cost of tensor (and pipeline) parallelism: TP=N with the mp executor vs TP=1, communication timed apart.

    python -m benchmarks.distributed_tp --model tiny --tp 2 --rounds 3
    python -m benchmarks.distributed_tp --model default --tp 3 --rounds 2   # SmolLM2-135M: 9 heads, 3 KV heads
    python -m benchmarks.distributed_tp --model tiny --tp 2 --gloo          # + TP=2 with its collectives on gloo

Both engines stay up for the whole run and each round runs the same workload on one, then the other,
so the ratios of a round compare like with like on a machine whose speed drifts. A workload: ``--seqs``
greedy requests of ``--prompt`` random tokens, ``--decode`` tokens each; the prefill is the steps until
every request has its first token, a decode step is any step after that. The ranks share the machine's
cores (the CPU platform gives each rank cores / ranks torch threads, the TP=1 engine all of them);
collective time is the wall time each rank spends inside all-reduce / all-gather (waiting for the slower
peer included), per decode step, the larger of the ranks'.
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


def _tiny_model(path: Path) -> str:
    import transformers

    from pagoda.testing.model_parity import build_tiny_model, save_tiny_model

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return str(save_tiny_model(build_tiny_model(cfg), path))


def _engine(model: str | None, tp: int, dtype: str, backend: str, threads: int | None = None, pp: int = 1,
            shm: bool = True) -> Any:
    from pagoda.config import EngineArgs
    from pagoda.engine.core import EngineCore, prepare_engine_config

    # read by the workers' platform when they start (the mp workers are spawned inside EngineCore)
    settings = {"PAGODA_CPU_THREADS": None if threads is None else str(threads),
                "PAGODA_CPU_SHM_ALLREDUCE": None if shm else "0"}
    before = {key: os.environ.pop(key, None) for key in settings}
    os.environ.update({key: value for key, value in settings.items() if value is not None})
    try:
        return _build(EngineArgs, EngineCore, prepare_engine_config, model, tp, dtype, backend, pp)
    finally:
        for key, value in before.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _build(EngineArgs: Any, EngineCore: Any, prepare_engine_config: Any, model: str | None, tp: int, dtype: str,
           backend: str, pp: int) -> Any:
    args = EngineArgs(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend=backend,
                      dtype=dtype, max_model_len=512, num_kv_blocks=256, skip_tokenizer_init=model is not None,
                      quantization="none" if model is None else None)
    config = args.create_engine_config()
    platform = prepare_engine_config(config)
    return EngineCore(config, platform)


def _workload(core: Any, seqs: int, prompt: int, decode: int, seed: int) -> dict[str, float]:
    from pagoda import SamplingParams
    from pagoda.scheduler.request import Request

    rng = random.Random(seed)
    vocab = int(core.config.resolved.vocab_size)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        core.add_request(Request(f"s{seed}-{i}", ids, params, None, core.block_size))
    tp = core.config.parallel_config.world_size
    produced: dict[str, int] = {}
    prefill = 0.0
    decode_steps: list[float] = []
    in_decode = False
    while core.has_work():
        t0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - t0
        for out in outputs:
            produced[out.req_id] = produced.get(out.req_id, 0) + len(out.new_token_ids)
        if in_decode:
            decode_steps.append(dt)
        else:
            prefill += dt
            if len(produced) == seqs:
                in_decode = True
                if tp > 1:
                    core.model_executor.collective_rpc("get_comm_stats")  # reset: decode steps only from here
    comm = 0.0
    calls = 0
    if tp > 1:
        stats = core.model_executor.collective_rpc("get_comm_stats")
        comm = max(s["seconds"] for s in stats) / max(1, len(decode_steps))
        calls = int(stats[0]["calls"]) // max(1, len(decode_steps))
    return {"prefill_s": prefill, "decode_step_ms": 1e3 * statistics.median(decode_steps),
            "comm_ms": 1e3 * comm, "collectives_per_step": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random 2-layer Llama), 'default' (SmolLM2-135M) or a path")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=0, help="also run pipeline_parallel_size=PP (one rank per stage)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gloo", action="store_true",
                        help="also run TP=N with PAGODA_CPU_SHM_ALLREDUCE=0 (collectives over gloo, not shared memory)")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp) / "tiny") if a.model == "tiny" else None if a.model == "default" else a.model
        cores = len(os.sched_getaffinity(0))
        # TP=1 as users run it (in-process, all cores), TP=1 in one worker process with one core's threads
        # (what each TP rank gets), and TP=N over N worker processes
        engines = {
            f"TP1 uni {cores}t": _engine(model, 1, a.dtype, "uni"),
            "TP1 mp 1t": _engine(model, 1, a.dtype, "mp", threads=1),
            f"TP{a.tp} mp": _engine(model, a.tp, a.dtype, "mp"),
        }
        if a.gloo:
            engines[f"TP{a.tp} mp gloo"] = _engine(model, a.tp, a.dtype, "mp", shm=False)
        if a.pp > 1:
            engines[f"PP{a.pp} mp"] = _engine(model, 1, a.dtype, "mp", pp=a.pp)
        try:
            for core in engines.values():
                _workload(core, 2, 8, 4, seed=-1)  # warm-up (kernel builds, first-touch pages)
            print(f"model={a.model} seqs={a.seqs} prompt={a.prompt} decode={a.decode} dtype={a.dtype}")
            for r in range(a.rounds):
                parts = []
                for label, core in engines.items():
                    load = os.getloadavg()[0]
                    res = _workload(core, a.seqs, a.prompt, a.decode, seed=r)
                    comm = (f" (collectives {res['comm_ms']:.2f} ms, {res['collectives_per_step']} calls)"
                            if res["collectives_per_step"] else "")
                    parts.append(f"{label} [load {load:.1f}]: decode step {res['decode_step_ms']:.2f} ms{comm}, "
                                 f"prefill {res['prefill_s'] * 1e3:.0f} ms")
                print(f"round {r}: " + " | ".join(parts), flush=True)
        finally:
            for core in engines.values():
                core.shutdown()


if __name__ == "__main__":
    main()
