"""Structured outputs: the per-step cost of masking beside an unconstrained step, and time to first token
with a new JSON schema vs a cached one, for each backend (default model, SmolLM2-135M GGUF).

    python -m benchmarks.structured_outputs [--backends xgrammar,guidance] [--requests 64] [--steps 32]

Backends are measured interleaved (round after round), so a loaded machine slows them alike.

1. The masking cost of one step for N constrained requests, on the engine's own parts: the structured-outputs
   manager filling the batch's bitmask from N matchers (each some tokens into a JSON schema; llguidance fills
   the rows in parallel) and applying it to [N, vocab] float32 logits (the backend's kernel, the engine's
   path), beside the decode step time of N unconstrained requests (the difference of two generate runs with
   ignore_eos, divided by the extra steps).
2. End to end: N requests constrained to a regex of fixed length (every request takes the same number of
   steps) vs the same N unconstrained with that many tokens (ignore_eos).
3. Compile time of a new schema (the backend's compile) and time to first token (max_tokens=1, one request)
   with a schema never seen before vs the same schema again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.structured_output.manager import StructuredOutputManager, load_backend_class

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "age": {"type": "integer"}}, "required": ["name", "tags", "age"]}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _new_schema(tag: str) -> dict[str, Any]:
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"field_{tag}_{time.time_ns()}"] = {"type": "integer"}
    return schema


class Bench:
    """One backend's engine and a manager of its own for the per-step parts."""

    def __init__(self, backend: str, n: int) -> None:
        self.name = backend
        self.n = n
        self.llm = LLM(max_num_seqs=n, structured_outputs_config={"backend": backend})
        self.tokenizer = self.llm.get_tokenizer()
        core = self.llm.llm_engine.engine_core.core
        self.vocab = int(core.config.resolved.text_config.vocab_size)
        self.manager = StructuredOutputManager(lambda: self.tokenizer, self.vocab, backend)
        prefix = self.tokenizer.encode('{"name": "Ann", "tags": ["a", "b"', add_special_tokens=False)
        self.requests = [self.manager.init_request(StructuredOutputsParams(json=SCHEMA)) for _ in range(n)]
        for request in self.requests:
            request._grammar.result()
            assert request.matcher.accept_tokens(prefix)
        self.logits = torch.randn(n, self.vocab)
        self.kernel = load_backend_class(backend).apply_token_bitmask
        self.prompts = [f"Person {i} as JSON:" for i in range(n)]
        self.fill: list[float] = []
        self.apply: list[float] = []
        self.compile: list[float] = []
        self.ttft_new: list[float] = []
        self.ttft_cached: list[float] = []

    def masking_round(self, repeats: int) -> None:
        for _ in range(repeats):
            self.fill.append(_timed(lambda: self.manager.grammar_bitmask(self.requests)))
        bitmask = self.manager.grammar_bitmask(self.requests).clone()
        for _ in range(repeats):
            self.apply.append(_timed(lambda: self.kernel(self.logits, bitmask)))

    def compile_round(self) -> None:
        backend = self.manager.backend
        params = StructuredOutputsParams(json=_new_schema(self.name))
        self.compile.append(_timed(lambda: backend.compile(params)))
        schema = _new_schema(self.name)

        def ttft() -> float:
            p = SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
            return _timed(lambda: self.llm.generate(["A person as JSON:"], p, use_tqdm=False))

        self.ttft_new.append(ttft())
        self.ttft_cached.append(ttft())

    def run(self, max_tokens: int, constrained: bool) -> float:
        if constrained:
            params = SamplingParams(temperature=0, max_tokens=max_tokens + 8,
                                    structured_outputs=StructuredOutputsParams(regex=f"[0-9]{{{max_tokens}}}"))
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return _timed(lambda: self.llm.generate(self.prompts, params, use_tqdm=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="xgrammar,guidance")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n, steps = args.requests, args.steps
    benches = [Bench(name, n) for name in args.backends.split(",")]
    for b in benches:
        b.run(4, False)
        b.run(4, True)  # compiles the regexes once
    step: dict[str, list[float]] = {b.name: [] for b in benches}
    e2e: dict[str, list[tuple[float, float]]] = {b.name: [] for b in benches}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for b in benches:
            b.masking_round(args.repeats)
            b.compile_round()
            short, long_ = b.run(1, False), b.run(1 + steps, False)
            step[b.name].append((long_ - short) / steps * 1e3)
            # digits are single tokens in SmolLM2's vocabulary: the regex run takes `steps` + 1 steps (then EOS)
            e2e[b.name].append((b.run(steps, True), b.run(steps + 1, False)))
        load.append(os.getloadavg()[0])

    med = statistics.median
    print(f"requests={n} vocab={benches[0].vocab} threads={torch.get_num_threads()} rounds={args.rounds} "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f}")
    for b in benches:
        constrained = med(c for c, _ in e2e[b.name])
        unconstrained = med(u for _, u in e2e[b.name])
        print(f"[{b.name}] fill bitmask ({n} requests): {med(b.fill) * 1e3:.3f} ms; apply to [{n}, {b.vocab}] "
              f"logits: {med(b.apply) * 1e3:.3f} ms; unconstrained decode step: {med(step[b.name]):.2f} ms")
        print(f"[{b.name}] end to end, {n} requests x {steps} tokens: regex-constrained {constrained:.2f} s, "
              f"unconstrained {unconstrained:.2f} s ({(constrained / unconstrained - 1) * 100:+.1f}%)")
        print(f"[{b.name}] compile a new schema: {med(b.compile) * 1e3:.1f} ms; time to first token: new schema "
              f"{med(b.ttft_new) * 1e3:.1f} ms, cached {med(b.ttft_cached) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
