"""The shipped SmolLM2-135M Q4_1 file kept in blocks, against the same file dequantized to float32:
greedy tokens agree (up to near-ties), and the process holds at most half the memory after loading.

Each load runs in its own process, so the resident memory is that load's alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "In 1492, Columbus",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
]

SCRIPT = """
import json, sys
from pagoda import LLM, SamplingParams

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

quantization = None if sys.argv[1] == "auto" else sys.argv[1]
llm = LLM(quantization=quantization, dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
rss = rss_mib()
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, logprobs=5))
print("RESULT" + json.dumps({"rss_mib": rss, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                             "logprobs": [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                                          for o in outs]}))
"""


def _run(quantization: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, quantization, json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {"gguf": _run("auto"), "none": _run("none")}


# The kernels quantize the activations to int8 per 32-block (as llama.cpp's CPU backend), so a near-tie of the
# float32 model can fall the other way, and where depends on the CPU's kernels: on Zen 5 (AVX-512) 6 of these 8
# prompts agreed whole, on Zen 3 (AVX2) 4, every split within 0.22 nats.
NEAR_TIE = 0.5


def test_greedy_tokens_agree_with_the_dequantized_model(runs: dict[str, dict]) -> None:
    """Token for token up to the first split, and a split only at a near-tie of the dequantized run's logprobs."""
    kept, dequantized = runs["gguf"]["tokens"], runs["none"]["tokens"]
    for prompt, a, b, top in zip(PROMPTS, kept, dequantized, runs["none"]["logprobs"]):
        split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if split is None:
            continue
        gap = top[split][str(b[split])] - top[split].get(str(a[split]), float("-inf"))
        assert gap <= NEAR_TIE, (prompt, split, a, b, top[split])
    assert sum(a == b for a, b in zip(kept, dequantized)) >= len(PROMPTS) // 2, (kept, dequantized)


def test_resident_memory_at_most_half_of_the_float32_load(runs: dict[str, dict]) -> None:
    kept, dequantized = runs["gguf"]["rss_mib"], runs["none"]["rss_mib"]
    assert kept <= 0.5 * dequantized, (kept, dequantized)
