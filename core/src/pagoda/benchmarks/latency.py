"""Latency of one batch: time to first token and per-token decode time, repeated."""

from __future__ import annotations

import time
from typing import Any

from pagoda.benchmarks.datasets import BenchRequest
from pagoda.benchmarks.report import percentiles


def run_latency(llm: Any, requests: list[BenchRequest], num_iters: int = 3, warmup_iters: int = 1) -> dict[str, Any]:
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    ttfts: list[float] = []
    decode_per_token: list[float] = []
    e2e: list[float] = []
    for it in range(warmup_iters + num_iters):
        ids = []
        start = time.perf_counter()
        for i, r in enumerate(requests):
            rid = f"lat-{it}-{i}"
            engine.add_request(rid, {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                                              output_kind=RequestOutputKind.DELTA))
            ids.append(rid)
        first: float | None = None
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = sum(len(o.token_ids) for o in out.outputs)
                if n and first is None:
                    first = time.perf_counter()
                tokens += n
        end = time.perf_counter()
        if it < warmup_iters or first is None:
            continue
        ttfts.append(first - start)
        e2e.append(end - start)
        steps = max(r.output_len for r in requests) - 1
        if steps > 0:
            decode_per_token.append((end - first) / steps)
    return {
        "batch_size": len(requests),
        "ttft_s": percentiles(ttfts),
        "decode_s_per_token": percentiles(decode_per_token),
        "decode_tokens_per_s_per_sequence": 1.0 / percentiles(decode_per_token)["p50"] if decode_per_token else float("nan"),
        "e2e_s": percentiles(e2e),
    }
