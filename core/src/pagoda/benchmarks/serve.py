"""Online serving benchmark against any OpenAI-compatible server (ours or another).

Two modes. Continuous (vLLM's ``vllm bench serve``): requests arrive at ``request_rate``
(Poisson, or gamma-distributed gaps with ``burstiness``, as vLLM draws them) under at most
``max_concurrency`` in flight. Bursts (pagoda-only, ``run_serve_bursts``): rounds of N
requests sent at the same instant, each round waiting for the last one to finish, with
throughput and latency reported per round -- the shape of a traffic spike, where the
tail of time-to-first-token is decided by how the server admits a whole burst of prefills.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.benchmarks.datasets import BenchRequest
from pagoda.benchmarks.report import percentiles


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client: Any, url: str, model: str, req: BenchRequest, headers: dict[str, str]) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    result.output_tokens = payload["usage"].get("completion_tokens", 0)
                choices = payload.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # network errors count as failed requests, not a crashed benchmark
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def _gap(rng: random.Random, request_rate: float, burstiness: float) -> float:
    """Seconds until the next arrival: gamma with shape ``burstiness`` and mean 1 / rate (vLLM's draw; 1.0 is Poisson)."""
    if request_rate == float("inf"):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))


async def _run(base_url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None,
               request_rate: float, api_key: str | None, seed: int,
               burstiness: float = 1.0) -> tuple[list[RequestResult], float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def guarded(req: BenchRequest) -> RequestResult:
            async with limit:
                return await _one(client, url, model, req, headers)

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(_gap(rng, request_rate, burstiness))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _check_rate(request_rate: float, burstiness: float, max_concurrency: int | None) -> None:
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (inf sends every request at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    """Counts, throughput over ``elapsed`` and latency percentiles of finished requests."""
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return {
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "request_throughput": len(good) / elapsed if elapsed > 0 else 0.0,
        "output_tokens_per_s": out_tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in good]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in good for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in good]),
    }


def run_serve(base_url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None = None,
              request_rate: float = float("inf"), api_key: str | None = None, seed: int = 0,
              burstiness: float = 1.0) -> dict[str, Any]:
    """The continuous mode: arrivals at ``request_rate``, at most ``max_concurrency`` in flight."""
    _check_rate(request_rate, burstiness, max_concurrency)
    results, elapsed = asyncio.run(
        _run(base_url, model, requests, max_concurrency, request_rate, api_key, seed, burstiness)
    )
    return summarize(results, elapsed)


def run_serve_bursts(base_url: str, model: str, requests: list[BenchRequest], burst: int,
                     api_key: str | None = None) -> dict[str, Any]:
    """pagoda-only burst mode: ``len(requests) / burst`` rounds of ``burst`` simultaneous requests.

    A round starts when the previous one has fully finished; ``rounds`` holds each round's own
    throughput (its output tokens over its wall time) and latencies, the top level all rounds
    together (elapsed = the sum of the rounds' times).
    """
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst}")
    if not requests or len(requests) % burst:
        raise ValueError(f"burst mode needs a whole number of rounds: {len(requests)} requests, bursts of {burst}")
    rounds: list[dict[str, Any]] = []
    everything: list[RequestResult] = []
    total = 0.0
    for start in range(0, len(requests), burst):
        results, elapsed = asyncio.run(
            _run(base_url, model, requests[start:start + burst], None, float("inf"), api_key, 0)
        )
        summary = summarize(results, elapsed)
        summary.pop("errors")
        rounds.append(summary)
        everything.extend(results)
        total += elapsed
    return summarize(everything, total) | {"burst": burst, "num_rounds": len(rounds), "rounds": rounds}
