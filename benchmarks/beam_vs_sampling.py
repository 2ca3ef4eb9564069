"""Beam search (beam_width 4) beside parallel sampling (n=4) on the same prompts: output tokens/s.

    python -m benchmarks.beam_vs_sampling [--model PATH] [--prompts 64] [--max-tokens 32]

Without --model it builds a small random Llama (vocab 49152, 4 layers, hidden 256) in a
temporary folder, so the numbers show the engine's cost rather than one checkpoint's.
Both runs generate the same number of sequences per prompt (4) for the same number of
steps (ignore_eos), so tokens/s compares the cost per generated token directly.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import BeamSearchParams


def build_model(path: str) -> None:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="beam-bench-")
        build_model(model)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=512)
    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]} for _ in range(args.prompts)]

    # warm-up (first-call overheads)
    llm.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(n=args.width, temperature=1.0, max_tokens=args.max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    sample_s = time.perf_counter() - t0
    sample_tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)

    t0 = time.perf_counter()
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens,
                                                      ignore_eos=True))
    beam_s = time.perf_counter() - t0
    # every live beam computes one token per step: W beams x max_tokens steps per prompt
    beam_tokens = args.prompts * args.width * args.max_tokens
    kept = sum(len(s.tokens) - args.prompt_len for b in beams for s in b.sequences)

    assert llm.llm_engine.get_stats().kv_cache_usage == 0, "blocks leaked"
    print(f"prompts={args.prompts} width={args.width} max_tokens={args.max_tokens} model={model}")
    print(f"sampling n={args.width}:       {sample_tokens} tokens in {sample_s:.2f}s = {sample_tokens / sample_s:.0f} tok/s")
    print(f"beam search width={args.width}: {beam_tokens} tokens in {beam_s:.2f}s = {beam_tokens / beam_s:.0f} tok/s "
          f"({kept} tokens in the returned sequences)")
    print(f"beam / sampling time per token: {(beam_s / beam_tokens) / (sample_s / sample_tokens):.2f}")


if __name__ == "__main__":
    main()
