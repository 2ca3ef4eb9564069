"""`pagoda serve --speculative-config '<json>'`: n-gram speculation on the default model (SmolLM2-135M-Instruct)
counts its drafts and accepted tokens in /metrics and logs vLLM's SpecDecoding metrics line. (Greedy equality
is tested on float models in tests/test_spec_decode.py: the default model's GGUF matmul rounds a verify step's
rows and a decode's differently, so a near-tie could go either way.)"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai

MODEL = "SmolLM2-135M-Instruct"
# a list the model continues by repeating its own pattern: n-gram lookups hit
PROMPT = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,"


def _metric(text: str, name: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(f"pagoda:{name}{{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric pagoda:{name} missing from /metrics"
    return total


def test_serve_with_ngram_speculation_counts_accepted_tokens(start_server: Any) -> None:
    spec = start_server(["--max-model-len", "512", "--max-num-seqs", "8", "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                         '"prompt_lookup_min": 2}'], env={"PAGODA_LOG_STATS_INTERVAL": "0.01"})
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert out.usage.completion_tokens > 10 and "Monday" in out.choices[0].text
    text = httpx.get(spec.url + "/metrics", timeout=10).text
    assert _metric(text, "spec_decode_num_drafts_total") > 0
    assert _metric(text, "spec_decode_num_draft_tokens_total") > 0
    assert _metric(text, "spec_decode_num_accepted_tokens_total") > 0
    assert _metric(text, "spec_decode_num_accepted_tokens_per_pos_total") > 0
    assert 'position="0"' in text
    deadline = time.monotonic() + 10
    while "SpecDecoding metrics: Mean acceptance length" not in spec.output():
        assert time.monotonic() < deadline, "no SpecDecoding metrics log line"
        time.sleep(0.2)
