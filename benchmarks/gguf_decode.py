"""W2 decode on a GGUF file: pagoda kept in blocks (the gguf method) against the same file dequantized
(float32, bfloat16) and against llama.cpp (llama-cpp-python), interleaved in one run.

usage: python -m benchmarks.gguf_decode [--model FILE.gguf] [--rounds 3] [--threads 2] [--configs ...]
                                       [--baseline DIR] [--llamacpp-python PYTHON]

W2: one prompt of 128 random token ids, 128 tokens out, greedy, EOS ignored. Every configuration runs
in its own process (round-robin, so load changes hit all alike) and reports: its resident memory after
loading (/proc/self/statm), the prefill time (one token out) and the decode rate
(127 tokens / (t(128 out) - t(1 out))). llama.cpp's decode is timed around its own decode loop.
Prints one JSON line per run and a median table.

``--baseline DIR`` adds the config ``baseline-gguf-fp32``: pagoda-gguf-fp32 with DIR first on
PYTHONPATH, e.g. an older commit's plugin source (``git archive REV plugins/quant_gguf/src | tar -x
-C DIR`` and pass DIR/plugins/quant_gguf/src), to compare a kernel change before/after in one run.
``--llamacpp-python`` runs the llama.cpp config under another interpreter (a venv holding
llama-cpp-python); it needs only llama_cpp and numpy.
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

INPUT_LEN, OUTPUT_LEN = 128, 128
CONFIGS = {
    # name: (runner, quantization, dtype)
    "pagoda-gguf-fp32": ("pagoda", None, "float32"),
    "pagoda-gguf-bf16": ("pagoda", None, "bfloat16"),
    "pagoda-dequant-fp32": ("pagoda", "none", "float32"),
    "pagoda-dequant-bf16": ("pagoda", "none", "bfloat16"),
    "llama.cpp": ("llamacpp", None, None),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prompt(vocab: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1000, vocab) for _ in range(INPUT_LEN)]


def run_pagoda(model: str | None, quantization: str | None, dtype: str, threads: int) -> dict:
    os.environ.setdefault("PAGODA_CPU_THREADS", str(threads))
    from pagoda import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, quantization=quantization, dtype=dtype, max_model_len=INPUT_LEN + OUTPUT_LEN + 16,
              num_kv_blocks=64, max_num_seqs=1)
    load_s, rss = time.perf_counter() - t0, _rss_mib()
    prompt = [{"prompt_token_ids": _prompt(49152)}]

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    timed(8)  # warm-up
    first = min(timed(1) for _ in range(2))
    full = timed(OUTPUT_LEN)
    return {"load_s": load_s, "rss_mib": rss, "prefill_s": first, "decode_tok_s": (OUTPUT_LEN - 1) / (full - first)}


def run_llamacpp(model: str, threads: int) -> dict:
    import ctypes

    import llama_cpp as lc  # type: ignore[import-not-found]
    import numpy as np

    lc.llama_backend_init()
    t0 = time.perf_counter()
    lmodel = lc.llama_model_load_from_file(model.encode(), lc.llama_model_default_params())
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = INPUT_LEN + OUTPUT_LEN + 16
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(lmodel, cparams)
    load_s, rss = time.perf_counter() - t0, _rss_mib()
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(lmodel))
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> int:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        row = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float)), shape=(vocab,))
        return int(row.argmax())

    def generate(prompt: list[int], n: int) -> tuple[float, float]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        t = time.perf_counter()
        tok = decode(prompt, 0)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(1, n):
            tok = decode([tok], len(prompt) + step - 1)
        return prefill, time.perf_counter() - t

    generate(_prompt(vocab)[:8], 8)  # warm-up
    prefill, decode_s = generate(_prompt(vocab), OUTPUT_LEN)
    return {"load_s": load_s, "rss_mib": rss, "prefill_s": prefill, "decode_tok_s": (OUTPUT_LEN - 1) / decode_s,
            "llama_cpp": lc.__version__}


def _worker(args: argparse.Namespace) -> None:
    runner, quantization, dtype = CONFIGS["pagoda-gguf-fp32" if args.worker == "baseline-gguf-fp32" else args.worker]
    if runner == "llamacpp":
        result = run_llamacpp(args.model, args.threads)
    else:
        result = run_pagoda(args.model, quantization, dtype, args.threads)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file; default: the embedded SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--baseline", default=None, help="plugin source folder put first on PYTHONPATH for baseline-gguf-fp32")
    parser.add_argument("--llamacpp-python", default=sys.executable, help="interpreter for the llama.cpp config")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from pagoda.model_loader.source import default_model_path

        args.model = str(default_model_path())
    if args.worker is not None:
        _worker(args)
        return
    names = args.configs.split(",") + (["baseline-gguf-fp32"] if args.baseline else [])
    unknown = set(names) - set(CONFIGS) - {"baseline-gguf-fp32"}
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    results: dict[str, list[dict]] = {name: [] for name in names}
    print(f"# load average before: {os.getloadavg()}", flush=True)
    for r in range(args.rounds):
        for name in names:
            env = dict(os.environ)
            if name == "baseline-gguf-fp32":
                env["PYTHONPATH"] = os.pathsep.join(p for p in (args.baseline, env.get("PYTHONPATH")) if p)
            python = args.llamacpp_python if CONFIGS.get(name, ("",))[0] == "llamacpp" else sys.executable
            proc = subprocess.run([python, "-m", "benchmarks.gguf_decode", "--worker", name, "--model", args.model,
                                   "--threads", str(args.threads)], capture_output=True, text=True, timeout=1800, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            result = json.loads(line.removeprefix("RESULT "))
            results[name].append(result)
            print(json.dumps({"round": r, "config": name, **result, "loadavg": os.getloadavg()[0]}), flush=True)
    print(f"# load average after: {os.getloadavg()}")
    print("| config | decode tok/s (median; runs) | prefill 128 s | RSS after load MiB |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        if not runs:
            continue
        rates = [r["decode_tok_s"] for r in runs]
        print(f"| {name} | {statistics.median(rates):.1f} ({', '.join(f'{x:.1f}' for x in rates)}) | "
              f"{statistics.median(r['prefill_s'] for r in runs):.3f} | {statistics.median(r['rss_mib'] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
