"""Offline throughput: LLM.generate over a dataset."""

from __future__ import annotations

import time
from typing import Any

from pagoda.benchmarks.datasets import BenchRequest


def timed_generate(llm: Any, requests: list[BenchRequest], temperature: float = 0.0,
                   use_tqdm: bool = True, warmup: bool = True) -> tuple[list[Any], float]:
    """``llm.generate`` on the requests (ignore_eos, each its own output length): (outputs, seconds)."""
    from pagoda.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=temperature, ignore_eos=True) for r in requests]
    if warmup:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return outputs, time.perf_counter() - start


def run_throughput(llm: Any, requests: list[BenchRequest], temperature: float = 0.0,
                   use_tqdm: bool = True, warmup: bool = True) -> dict[str, Any]:
    outputs, elapsed = timed_generate(llm, requests, temperature, use_tqdm, warmup)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(r.prompt_len for r in requests)
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
    }
