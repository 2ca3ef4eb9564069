"""W1 (offline, 64 x 128 -> 128, greedy, EOS ignored) on the default model: the base alone, the base in an
engine with enable_lora (base rows only: what the LoRA path costs a request without an adapter), and the
64 requests spread over 8 distinct rank-16 adapters (every projection adapted, max_loras=8).

usage: python -m benchmarks.lora [--rounds 1] [--threads 2] [--configs base,lora-engine,lora8] [--num 64]
       python -m benchmarks.lora --kernel [--compare-with /other/checkout]   (each projection with and
       without the torch LoRA kernel; optionally another tree's kernel beside it, interleaved)

The adapters are written once under a temporary directory as PEFT files (random factors, every
q/k/v/o/gate/up/down projection of every layer). Each configuration runs in its own process, round
robin over the rounds, and prints one JSON line; then a median table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from benchmarks._rounds import alternate

CONFIGS = ("base", "lora-engine", "lora8")
INPUT_LEN, OUTPUT_LEN, NUM_ADAPTERS, RANK = 128, 128, 8, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(root: Path, hf_config: object) -> list[Path]:
    """NUM_ADAPTERS PEFT adapters of rank RANK on every projection of the model ``hf_config`` describes."""
    import torch
    from safetensors.torch import save_file

    cfg: object = hf_config
    hidden = cfg.hidden_size  # type: ignore[attr-defined]
    heads = cfg.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    inter = cfg.intermediate_size  # type: ignore[attr-defined]
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    paths = []
    for n in range(NUM_ADAPTERS):
        path = root / f"adapter{n}"
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):  # type: ignore[attr-defined]
            for name in TARGETS:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if name.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 32,
                                                             "target_modules": list(TARGETS)}))
        paths.append(path)
    return paths


def run_one(name: str, threads: int, num: int, adapters: list[str]) -> dict:
    os.environ.setdefault("PAGODA_CPU_THREADS", str(threads))
    from pagoda import LLM, LoRARequest, SamplingParams
    from pagoda.benchmarks.datasets import random_requests

    lora = {} if name == "base" else dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    llm = LLM(model=None, dtype="float32", max_model_len=INPUT_LEN + OUTPUT_LEN + 16, **lora)
    requests = random_requests(num, INPUT_LEN, OUTPUT_LEN, llm.llm_engine.vocab_size)
    loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]
    per_prompt = [loras[i % len(loras)] for i in range(num)] if name == "lora8" else None
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    # warm-up (and the adapters read once): a short pass over the same mix
    llm.generate(prompts[:NUM_ADAPTERS], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                 lora_request=per_prompt[:NUM_ADAPTERS] if per_prompt else None)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"config": name, "elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


# SmolLM2-135M's projections (name, in, stacked slice widths): qkv (GQA: 9 query, 3 KV heads of 64), o,
# gate_up, down; every one adapted at rank RANK per slice in each of the NUM_ADAPTERS slots
KERNEL_LAYERS = (("qkv_proj", 576, (576, 192, 192)), ("o_proj", 576, (576,)), ("gate_up_proj", 576, (1536, 1536)),
                 ("down_proj", 1536, (576,)))
# (name, token slots): decode rows over 8 adapters; one 512-token prefill chunk of one adapter beside 63
# decode rows (the segment plan); a 512-row prefill spread over 8 adapters
KERNEL_MIXES = (("decode-64x8", [i % NUM_ADAPTERS for i in range(64)]),
                ("prefill512+63", [0] * 512 + [1 + i % (NUM_ADAPTERS - 1) for i in range(63)]),
                ("prefill-512x8", [i % NUM_ADAPTERS for i in range(512)]))


def _punica_of(tree: str | None) -> ModuleType:
    """``pagoda.lora.punica`` of this process, or the one of the checkout at ``tree`` (for before/after)."""
    if tree is None:
        from pagoda.lora import punica
        return punica
    spec = importlib.util.spec_from_file_location("punica_other", Path(tree) / "core/src/pagoda/lora/punica.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def kernel_overhead(threads: int, compare_with: str | None = None, repeats: int = 100) -> list[dict]:
    """Each projection's matmul alone and with the LoRA kernel added, interleaved in one process (and the
    kernel of the checkout ``compare_with`` beside this one's, same shapes and factors): the slots hold
    block-diagonal factors as ``LoRASlots`` writes them, so every kernel computes the same sum."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    kernels = {"lora8": _punica_of(None)}
    if compare_with:
        kernels["other"] = _punica_of(compare_with)
    out = []
    for mix, token_slots in KERNEL_MIXES:
        rows = len(token_slots)
        slots = torch.tensor(token_slots)
        mappings = {"lora8": kernels["lora8"].build_step_mapping(slots, NUM_ADAPTERS, torch.device("cpu"))}
        if compare_with:  # the first kernel's signature (its mapping carried a one-hot in the adapters' dtype)
            mappings["other"] = kernels["other"].build_step_mapping(slots, NUM_ADAPTERS, torch.float32,
                                                                    torch.device("cpu"))
        for layer, d_in, widths in KERNEL_LAYERS:
            d_out, block = sum(widths), RANK * len(widths)
            x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)
            a = torch.randn(NUM_ADAPTERS * block, d_in) * 0.01
            b = torch.zeros(NUM_ADAPTERS * block, d_out)
            for s in range(NUM_ADAPTERS):
                for i, lo in enumerate(sum(widths[:i]) for i in range(len(widths))):
                    b[s * block + i * RANK:s * block + (i + 1) * RANK, lo:lo + widths[i]] = \
                        torch.randn(RANK, widths[i]) * 0.01
            stacked = widths if len(widths) > 1 else None
            calls = {"base": lambda: F.linear(x, w)}
            calls["lora8"] = lambda: kernels["lora8"].TORCH_LORA_KERNEL.add_lora_linear(
                F.linear(x, w), x, a, b, mappings["lora8"], stacked)
            if compare_with:
                calls["other"] = lambda: kernels["other"].TORCH_LORA_KERNEL.add_lora_linear(
                    F.linear(x, w), x, a, b, mappings["other"])
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(repeats):
                for k, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    times[k].append(time.perf_counter() - t0)
            # the median and, for a contended machine, the minimum (the cost of the work with the least
            # interference)
            out.append({"mix": mix, "layer": f"{layer} {d_in}->{d_out}",
                        **{f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items()},
                        **{f"{k}_min_us": min(v) * 1e6 for k, v in times.items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--kernel", action="store_true", help="only the per-layer kernel overhead (seconds, not minutes)")
    parser.add_argument("--compare-with", metavar="TREE",
                        help="with --kernel: also time the kernel of the checkout TREE (before/after, interleaved)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernel:
        print(f"# load average before: {os.getloadavg()}")
        other = f" | {args.compare_with} kernel us | ratio" if args.compare_with else ""
        print("# us: median (min) of the interleaved repeats; ratio of the medians")
        print(f"| rows | layer | F.linear us | + LoRA (8 adapters, r=16) us | ratio{other} |")
        print("|---|---|---|---|---|" + ("---|---|" if args.compare_with else ""))
        for r in kernel_overhead(args.threads, args.compare_with):
            line = (f"| {r['mix']} | {r['layer']} | {r['base_us']:.0f} ({r['base_min_us']:.0f}) | "
                    f"{r['lora8_us']:.0f} ({r['lora8_min_us']:.0f}) | {r['lora8_us'] / r['base_us']:.2f} |")
            if args.compare_with:
                line += f" {r['other_us']:.0f} ({r['other_min_us']:.0f}) | {r['other_us'] / r['base_us']:.2f} |"
            print(line)
        print(f"# load average after: {os.getloadavg()}")
        return
    if args.one:
        print(json.dumps(run_one(args.one, args.threads, args.num, json.loads(args.adapters))))
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    from pagoda.config import EngineArgs, resolve_model
    from pagoda.platforms import resolve_platform

    hf_config = resolve_model(EngineArgs().create_engine_config().model, resolve_platform("cpu")).hf_config
    root = Path(tempfile.mkdtemp(prefix="pagoda-lora-bench-"))
    adapters = json.dumps([str(p) for p in write_adapters(root, hf_config)])
    runs = alternate("benchmarks.lora", names, args.rounds,
                     ["--threads", str(args.threads), "--num", str(args.num), "--adapters", adapters])
    print("| config | output tok/s (median; runs) |")
    print("|---|---|")
    for name, rs in runs.items():
        rates = [x["output_tokens_per_s"] for x in rs]
        print(f"| {name} | {statistics.median(rates):.1f} ({', '.join(f'{x:.1f}' for x in rates)}) |")


if __name__ == "__main__":
    main()
