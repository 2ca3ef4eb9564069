"""A Mixtral-shaped MoE model (8 experts, top-2): pagoda ``LLM.generate`` beside transformers' batched ``generate``.

    python -m benchmarks.moe_vs_transformers [--prompts 64] [--input-len 128] [--output-len 64]
        [--dtypes float32,bfloat16] [--repeats 1] [--hidden 512] [--layers 4]

Builds a random Mixtral (``pagoda.testing.model_parity.randomize_weights``: weights large
enough that greedy logits are not ties) in a temporary folder, then, per dtype, times the
same greedy workload on both engines in this process (same weights, same prompts, 2 warm-up
calls each first). transformers gets the whole batch in one ``generate`` call (left padding,
``sdpa`` attention, its default); pagoda gets the same prompts through ``LLM.generate``
with its defaults (chunked prefill, prefix caching). Output tok/s = generated tokens / wall
time of the call, prefill included. Also printed: how many of the greedy sequences agree.
"""

from __future__ import annotations

import argparse
import gc
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


@torch.inference_mode()
def hf_generate(model_dir: str, dtype: str, prompts: list[list[int]], out_len: int) -> tuple[list[list[int]], float]:
    """transformers' batched greedy generate, prompts left-padded: (new ids per prompt, seconds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw: dict[str, Any] = dict(do_sample=False, eos_token_id=None, pad_token_id=pad)
    for _ in range(2):
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, **kw)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
    elapsed = time.perf_counter() - t0
    del model
    gc.collect()
    return out[:, width:].tolist(), elapsed


def pagoda_generate(model_dir: str, dtype: str, prompts: list[list[int]], out_len: int) -> tuple[list[list[int]], float]:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    # warm-up on other prompts, so the timed run gets no prefix-cache hits from it
    rng = random.Random(1)
    warm = [[rng.randrange(8192) for _ in range(len(prompts[0]))] for _ in range(2)]
    for _ in range(2):
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    new = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return new, elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="pairs per dtype; the order alternates")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    model_dir = tempfile.mkdtemp(prefix="moe-bench-")
    cfg = build_model(model_dir, args.hidden, args.layers)
    print(
        f"Mixtral-shaped: hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; "
        f"{args.prompts} prompts x {args.input_len} -> {args.output_len} tokens, torch threads {torch.get_num_threads()}"
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(8192) for _ in range(args.input_len)] for _ in range(args.prompts)]
    total = args.prompts * args.output_len
    for dtype in args.dtypes.split(","):
        for rep in range(args.repeats):
            order = [("transformers", hf_generate), ("pagoda", pagoda_generate)]
            if rep % 2:
                order.reverse()
            results: dict[str, tuple[list[list[int]], float]] = {}
            for name, fn in order:
                results[name] = fn(model_dir, dtype, prompts, args.output_len)
            (hf_new, hf_s), (pg_new, pg_s) = results["transformers"], results["pagoda"]
            same = sum(a == b for a, b in zip(hf_new, pg_new))
            print(
                f"{dtype} run {rep + 1}: transformers {total / hf_s:7.1f} tok/s ({hf_s:.2f} s)  "
                f"pagoda {total / pg_s:7.1f} tok/s ({pg_s:.2f} s)  pagoda/transformers {hf_s / pg_s:.2f}x  "
                f"identical greedy sequences {same}/{len(prompts)}"
            )


if __name__ == "__main__":
    main()
