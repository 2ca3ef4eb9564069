"""A Mixtral-shaped MoE model (8 experts, top-2): pagoda ``LLM.generate`` beside transformers' batched ``generate``.

    python -m benchmarks.moe_vs_transformers [--prompts 64] [--input-len 128] [--output-len 64]
        [--dtypes float32,bfloat16] [--repeats 3] [--hidden 512] [--layers 4] [--threads N]

Builds a random Mixtral (``pagoda.testing.model_parity.randomize_weights``: weights large
enough that greedy logits are not ties) in a temporary folder, then, per dtype, times the
same greedy workload on both engines in this process (same weights, same prompts, 2 warm-up
calls each first). transformers gets the whole batch in one ``generate`` call (left padding,
``sdpa`` attention, its default); pagoda gets the same prompts through ``LLM.generate``
with its defaults (chunked prefill, prefix caching). Output tok/s = generated tokens / wall
time of the call, prefill included. Both engines stay loaded and take turns (``--repeats``
runs each, fresh prompts per run): on a shared machine the best run of each is the figure
least disturbed by neighbours. Also printed: how many of the greedy sequences agree.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from typing import Any

import torch


def build_model(path: str, hidden: int, layers: int, seed: int = 0) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    from pagoda.testing.model_parity import randomize_weights

    cfg = MixtralConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    randomize_weights(model, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    return cfg


class HFRunner:
    """transformers' batched greedy generate, prompts left-padded, ``sdpa`` attention (its default)."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        warm = [[1, 2, 3], [4, 5, 6, 7]]
        for _ in range(2):
            self.generate(warm, 2)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], out_len: int) -> list[list[int]]:
        width = max(map(len, prompts))
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                  do_sample=False, eos_token_id=None, pad_token_id=pad)
        return out[:, width:].tolist()


class PagodaRunner:
    """``LLM.generate`` with the engine's defaults (chunked prefill, prefix caching)."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        from pagoda import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
        warm = [[1, 2, 3], [4, 5, 6, 7]]
        for _ in range(2):
            self.generate(warm, 2)

    def generate(self, prompts: list[list[int]], out_len: int) -> list[list[int]]:
        from pagoda import SamplingParams

        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and dtype, alternating")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both engines (default: torch's); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["PAGODA_CPU_THREADS"] = str(args.threads)  # the CPU platform sets torch's count from it

    model_dir = tempfile.mkdtemp(prefix="moe-bench-")
    cfg = build_model(model_dir, args.hidden, args.layers)
    print(
        f"Mixtral-shaped: hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; "
        f"{args.prompts} prompts x {args.input_len} -> {args.output_len} tokens, torch threads {torch.get_num_threads()}"
    )
    total = args.prompts * args.output_len
    for dtype in args.dtypes.split(","):
        runners: dict[str, Any] = {"transformers": HFRunner(model_dir, dtype), "pagoda": PagodaRunner(model_dir, dtype)}
        times: dict[str, list[float]] = {name: [] for name in runners}
        same: list[int] = []
        for rep in range(args.repeats):
            # fresh prompts per repeat (no prefix-cache hits from an earlier one), the same for both engines
            rng = random.Random(rep)
            prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.input_len)] for _ in range(args.prompts)]
            names = list(runners) if rep % 2 == 0 else list(reversed(runners))
            new: dict[str, list[list[int]]] = {}
            for name in names:
                t0 = time.perf_counter()
                new[name] = runners[name].generate(prompts, args.output_len)
                times[name].append(time.perf_counter() - t0)
            same.append(sum(a == b for a, b in zip(new["transformers"], new["pagoda"])))
        line = [f"{dtype}:"]
        for name, ts in times.items():
            rates = ", ".join(f"{total / t:.0f}" for t in ts)
            line.append(f"{name} best {total / min(ts):.0f} tok/s (runs: {rates})")
        ratio = sorted(h / p for h, p in zip(times["transformers"], times["pagoda"]))
        line.append(f"pagoda/transformers best-vs-best {min(times['transformers']) / min(times['pagoda']):.2f}x "
                    f"(per pair {', '.join(f'{r:.2f}' for r in ratio)}); identical greedy sequences {same} of {args.prompts}")
        print("  ".join(line))
        del runners
        gc.collect()


if __name__ == "__main__":
    main()
