"""int8 W8A8 (compressed-tensors) beside its float checkpoint, and an fp8 KV cache beside bf16, interleaved in one run.

usage: python -m benchmarks.quant_int8_fp8kv [--rounds 2] [--threads 2] [--configs ...]

* W1 (64 prompts x 128 random token ids -> 128 tokens, greedy, EOS ignored) on a seeded random Llama
  (hidden 1024, intermediate 4096, 8 layers, 16 heads / 4 KV heads, vocabulary 8192; ~140M parameters):
  the float checkpoint in float32 and bfloat16 against its W8A8 checkpoint made with compressed-tensors
  (int8 weights per channel, activations per token), served with float32 and bfloat16 activations.
* decode with the KV cache in bf16 and fp8 (e4m3) on the embedded SmolLM2-135M (bf16): 16 prompts of
  1024 random tokens -> 128 tokens (KV reads dominate attention there).

Every configuration runs in its own process, round-robin (load changes hit all alike); prints one JSON
line per run, the load average, and a median table (output tokens / wall time of the generate call).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL_DIR = Path(os.environ.get("PAGODA_BENCH_DIR", "/tmp/pagoda-bench-int8"))
CONFIGS = {
    # name: (workload, checkpoint, dtype, kv_cache_dtype)
    "float-fp32": ("w1", "float", "float32", "auto"),
    "w8a8-fp32": ("w1", "w8a8", "float32", "auto"),
    "float-bf16": ("w1", "float", "bfloat16", "auto"),
    "w8a8-bf16": ("w1", "w8a8", "bfloat16", "auto"),
    "smollm2-kv-bf16": ("decode", None, "bfloat16", "auto"),
    "smollm2-kv-fp8": ("decode", None, "bfloat16", "fp8"),
}
# prompts, input, output; --short: W1's shape with 16 prompts x 32 out, 8 long prompts x 32 out (a loaded machine)
WORKLOADS = {"w1": (64, 128, 128), "decode": (16, 1024, 128)}
SHORT_WORKLOADS = {"w1": (16, 128, 32), "decode": (8, 1024, 32)}


def make_checkpoints() -> None:
    """The float checkpoint and its W8A8 twin (compressed-tensors), made once."""
    if (MODEL_DIR / "w8a8" / "config.json").exists():
        return
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from pagoda.testing.model_parity import build_tiny_model

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    model = build_tiny_model(cfg, seed=0)
    model.save_pretrained(MODEL_DIR / "float")
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is not None:
                w = module.weight.float()
                scale, _ = calculate_qparams(w.amin(dim=1), w.amax(dim=1), args)
                module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(MODEL_DIR / "w8a8")
    compressor.update_config(MODEL_DIR / "w8a8")


def run(name: str, threads: int, short: bool = False) -> dict:
    os.environ.setdefault("PAGODA_CPU_THREADS", str(threads))
    from pagoda import LLM, SamplingParams

    workload, checkpoint, dtype, kv = CONFIGS[name]
    prompts_n, input_len, output_len = (SHORT_WORKLOADS if short else WORKLOADS)[workload]
    model = None if checkpoint is None else str(MODEL_DIR / checkpoint)
    vocab = 49152 if checkpoint is None else 8192
    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=checkpoint is not None, dtype=dtype, kv_cache_dtype=kv,
              max_model_len=input_len + output_len + 16, kv_cache_memory_bytes=2 << 30)
    load_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(input_len)]} for _ in range(prompts_n)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"config": name, "load_s": round(load_s, 2), "elapsed_s": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--short", action="store_true", help="smaller workloads (see SHORT_WORKLOADS)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print("RESULT " + json.dumps(run(args.worker, args.threads, args.short)), flush=True)
        return
    make_checkpoints()
    names = args.configs.split(",")
    results: dict[str, list[float]] = {name: [] for name in names}
    print(f"# load average before: {os.getloadavg()}", flush=True)
    for _ in range(args.rounds):
        for name in names:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.quant_int8_fp8kv", "--worker", name,
                                   "--threads", str(args.threads), *(["--short"] if args.short else [])],
                                  capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"# {name} failed:\n{proc.stderr[-3000:]}", flush=True)
                continue
            result = json.loads(line[7:])
            results[name].append(result["output_tok_s"])
            print(json.dumps({**result, "loadavg": os.getloadavg()[0]}), flush=True)
    print(f"# load average after: {os.getloadavg()}")
    print("| config | output tok/s (runs) | median |")
    print("|---|---|---|")
    for name, values in results.items():
        if values:
            print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
