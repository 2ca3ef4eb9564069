"""Online serving benchmark against any OpenAI-compatible server (ours or another)."""

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


async def _run(base_url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None,
               request_rate: float, api_key: str | None, seed: int) -> tuple[list[RequestResult], float]:
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
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def run_serve(base_url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None = None,
              request_rate: float = float("inf"), api_key: str | None = None, seed: int = 0) -> dict[str, Any]:
    results, elapsed = asyncio.run(_run(base_url, model, requests, max_concurrency, request_rate, api_key, seed))
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return {
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "elapsed_s": elapsed,
        "request_throughput": len(good) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_s": percentiles([r.ttft for r in good]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in good for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in good]),
    }
