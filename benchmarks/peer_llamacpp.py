"""Run one offline workload on llama.cpp through llama-cpp-python's C API (executed by a python
that has llama_cpp installed; imports no pagoda).

usage: python peer_llamacpp.py MODEL.gguf NUM_PROMPTS INPUT_LEN OUTPUT_LEN THREADS
prints one JSON line with output tokens/s.

All sequences decode together in one llama_batch per step (one sequence id each), greedy by
argmax over the returned logits, so llama.cpp gets the same continuous-batching work pagoda
and vLLM get; prompts are prefilled in llama_batch chunks of n_batch tokens.
"""

import ctypes
import json
import random
import sys
import time

import numpy as np


def _api(module, *names):
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"llama_cpp has none of {names}")


def main() -> None:
    path, n, in_len, out_len, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    import llama_cpp as lc  # type: ignore[import-not-found]

    lc.llama_backend_init()
    t0 = time.perf_counter()
    mparams = lc.llama_model_default_params()
    model = _api(lc, "llama_model_load_from_file", "llama_load_model_from_file")(path.encode(), mparams)
    n_batch = 512
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n * (in_len + out_len) + 256
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    cparams.n_seq_max = max(n, 1)
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    if hasattr(cparams, "kv_unified"):
        # One KV stream per sequence: with a unified cache every sequence's attention runs
        # over all cells in use (masked): W1 fp32 measured 38.9 tok/s that way, 214 with this setting.
        cparams.kv_unified = False
    ctx = _api(lc, "llama_init_from_model", "llama_new_context_with_model")(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    startup = time.perf_counter() - t0
    if hasattr(lc, "llama_model_get_vocab") and hasattr(lc, "llama_vocab_n_tokens"):
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    else:
        vocab = lc.llama_n_vocab(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(in_len)] for _ in range(n)]
    batch = lc.llama_batch_init(max(n_batch, n), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits_rows(count: int) -> np.ndarray:
        ptr = lc.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(count, vocab))

    def run(prompts: list[list[int]], out_len: int) -> int:
        in_len = len(prompts[0])
        n = len(prompts)
        mem_clear = getattr(lc, "llama_memory_clear", None)
        if mem_clear is not None and hasattr(lc, "llama_get_memory"):
            mem_clear(lc.llama_get_memory(ctx), True)
        else:
            _api(lc, "llama_kv_self_clear", "llama_kv_cache_clear")(ctx)
        # prefill: prompts packed into n_batch-token batches; logits only at each prompt's last token
        flat = [(tok, pos, s, pos == in_len - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last: list[int] = []
        for start in range(0, len(flat), n_batch):
            chunk = flat[start : start + n_batch]
            decode(chunk)
            wanted = sum(1 for e in chunk if e[3])
            if wanted:
                last.extend(logits_rows(wanted).argmax(axis=1).tolist())
        produced = n
        for step in range(1, out_len):
            decode([(last[s], in_len + step - 1, s, True) for s in range(n)])
            last = logits_rows(n).argmax(axis=1).tolist()
            produced += n
        return produced

    run([p[:8] for p in prompts[:2]], 2)  # warm-up
    t = time.perf_counter()
    tokens = run(prompts, out_len)
    dt = time.perf_counter() - t
    print("PEER_RESULT " + json.dumps({"output_tokens": tokens, "elapsed_s": dt, "output_tokens_per_s": tokens / dt,
                                       "startup_s": startup, "llama_cpp": getattr(lc, "__version__", "?")}))


if __name__ == "__main__":
    main()
