"""Decode with a 4-bit GPTQ checkpoint beside its own weights dequantized to float32, alternating in one process.

usage: python -m benchmarks.quant_int4_decode [--rounds 3] [--threads 2] [--prompts 8] [--out 64]

A seeded random Llama (hidden 1024, intermediate 4096, 8 layers, 16 heads / 4 KV heads, vocabulary
8192; benchmarks.quant_int8_fp8kv's model) is packed as GPTQ (groups of 128) by the plugin tests'
writer (plugins/quant_gptq_awq/tests/int4_checkpoints.py); the float checkpoint holds exactly the
weights it stores, dequantized. Both load in float32 into one process; generate calls alternate
(load changes hit both alike); greedy, EOS ignored, ``--prompts`` x 32 random tokens -> ``--out``
tokens. Prints tokens/s per call, the medians, their ratio and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

MODEL_DIR = Path(os.environ.get("PAGODA_BENCH_DIR", "/tmp/pagoda-bench-int4"))


def make_checkpoints() -> None:
    if (MODEL_DIR / "gptq" / "config.json").exists():
        return
    import transformers

    from pagoda.testing.model_parity import build_tiny_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "quant_gptq_awq" / "tests"))
    from int4_checkpoints import write_checkpoint

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    model = build_tiny_model(cfg, seed=0)
    write_checkpoint(model, MODEL_DIR / "gptq", "gptq", 128)
    model.save_pretrained(MODEL_DIR / "float")  # the dequantized weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("PAGODA_CPU_THREADS", str(args.threads))
    make_checkpoints()
    from pagoda import LLM, SamplingParams

    llms = {name: LLM(model=str(MODEL_DIR / name), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      num_kv_blocks=(args.prompts + 2) * 8) for name in ("gptq", "float")}
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(8192) for _ in range(32)]} for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
    print(f"# load average before: {os.getloadavg()}")
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for round_ in range(args.rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in out)
            rates[name].append(tokens / (time.perf_counter() - t))
            print(f"round {round_} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(f"median tok/s: gptq {medians['gptq']:.1f}, float32 {medians['float']:.1f}, "
          f"ratio {medians['gptq'] / medians['float']:.2f}; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
