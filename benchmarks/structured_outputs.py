"""Structured outputs: the per-step cost of masking beside an unconstrained step, and time to first token
with a new JSON schema vs a cached one (default model, SmolLM2-135M GGUF, xgrammar backend).

    python -m benchmarks.structured_outputs [--requests 64] [--steps 32]

1. The masking cost of one step for N constrained requests, measured on the engine's own parts: filling
   the batch's bitmask from N xgrammar matchers (each some tokens into a JSON schema) and applying it to
   [N, vocab] float32 logits (the backend's kernel, and core's torch fallback), beside the decode step time of N unconstrained requests (the difference of
   two generate runs with ignore_eos, divided by the extra steps).
2. End to end: N requests constrained to a regex of fixed length (every request takes the same number of
   steps) vs the same N unconstrained with that many tokens (ignore_eos).
3. Time to first token (max_tokens=1, one request) with a schema never seen before vs the same schema again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.structured_output import apply_token_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "age": {"type": "integer"}}, "required": ["name", "tags", "age"]}


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    n, steps = args.requests, args.steps
    llm = LLM(max_num_seqs=n)
    core = llm.llm_engine.engine_core.core
    manager = core.scheduler.structured_output_manager
    tokenizer = llm.get_tokenizer()
    prompts = [f"Person {i} as JSON:" for i in range(n)]

    # -- 1. masking parts of one step -------------------------------------------------------------
    prefix = tokenizer.encode('{"name": "Ann", "tags": ["a", "b"', add_special_tokens=False)
    grammar = manager.init_request(StructuredOutputsParams(json=SCHEMA))
    matchers = [grammar.matcher] + [grammar._grammar.result().new_matcher() for _ in range(n - 1)]
    for m in matchers:
        assert m.accept_tokens(prefix)
    fill = [_timed(lambda: manager.grammar_bitmask(matchers)) for _ in range(args.repeats)]
    bitmask = manager.grammar_bitmask(matchers).clone()
    vocab = int(core.config.resolved.text_config.vocab_size)
    logits = torch.randn(n, vocab)
    rows = torch.arange(n)
    apply = [_timed(lambda: apply_token_bitmask(logits, rows, bitmask)) for _ in range(args.repeats)]
    kernel = type(manager.backend).apply_token_bitmask
    apply_backend = [_timed(lambda: kernel(logits, bitmask)) for _ in range(args.repeats)]

    def run(max_tokens: int, constrained: bool) -> float:
        if constrained:
            params = SamplingParams(temperature=0, max_tokens=max_tokens + 8,
                                    structured_outputs=StructuredOutputsParams(regex=f"[0-9]{{{max_tokens}}}"))
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return _timed(lambda: llm.generate(prompts, params, use_tqdm=False))

    run(4, False)
    run(4, True)  # compiles the regexes once
    short, long_ = run(1, False), run(1 + steps, False)
    step_ms = (long_ - short) / steps * 1e3
    # digits are single tokens in SmolLM2's vocabulary: the regex run takes `steps` + 1 steps (the last emits EOS)
    constrained = run(steps, True)
    unconstrained = run(steps + 1, False)

    # -- 3. time to first token: new schema vs cached ----------------------------------------------
    def ttft(schema: dict[str, object]) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        return _timed(lambda: llm.generate(["A person as JSON:"], params, use_tqdm=False))

    new, cached = [], []
    for i in range(5):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"field_{i}_{time.time_ns()}"] = {"type": "integer"}
        new.append(ttft(schema))
        cached.append(ttft(schema))
    plain = statistics.median(_timed(lambda: llm.generate(["A person as JSON:"], SamplingParams(
        temperature=0, max_tokens=1), use_tqdm=False)) for _ in range(5))

    med = statistics.median
    print(f"requests={n} vocab={vocab} threads={torch.get_num_threads()}")
    print(f"fill bitmask ({n} matchers): {med(fill) * 1e3:.3f} ms; apply to [{n}, {vocab}] logits: "
          f"{med(apply_backend) * 1e3:.3f} ms ({type(manager.backend).__name__}.apply_token_bitmask, the engine's path), "
          f"{med(apply) * 1e3:.3f} ms (core's torch version)")
    print(f"unconstrained decode step ({n} requests): {step_ms:.2f} ms")
    print(f"end to end, {n} requests x {steps} tokens: regex-constrained {constrained:.2f} s, unconstrained "
          f"{unconstrained:.2f} s ({(constrained / unconstrained - 1) * 100:+.1f}%)")
    print(f"time to first token: new schema {med(new) * 1e3:.1f} ms, cached {med(cached) * 1e3:.1f} ms, "
          f"unconstrained {plain * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
