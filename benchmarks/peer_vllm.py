"""Run one offline workload on vLLM (executed by a vLLM virtualenv's python; imports no pagoda).

usage: python peer_vllm.py MODEL_DIR DTYPE NUM_PROMPTS INPUT_LEN OUTPUT_LEN
prints one JSON line with output tokens/s.
"""

import json
import random
import sys
import time


def main() -> None:
    model, dtype, n, in_len, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0)
    startup = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(in_len)]} for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("PEER_RESULT " + json.dumps({"output_tokens": tokens, "elapsed_s": dt, "output_tokens_per_s": tokens / dt,
                                       "startup_s": startup}))


if __name__ == "__main__":
    main()
