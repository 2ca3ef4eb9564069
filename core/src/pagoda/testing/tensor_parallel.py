"""One checkpoint served at tensor_parallel_size=2 against the same checkpoint at 1: greedy tokens and top logprobs.

For checkpoints whose reference is pagoda itself rather than transformers (a quantized model: the
methods' slicing across ranks is what is under test). Both runs serve the same prompts
(``mixed_prompts``: 8 of up to 40 tokens); the two-rank run uses the mp executor, its ranks talking
over loopback (gloo, ``GLOO_SOCKET_IFNAME=lo``, ``MASTER_ADDR=127.0.0.1``).

A greedy token may differ only where the single-rank run had a near-tie (top-2 logprob gap under
``tie_gap``): the rest of that prompt then follows another path and is not compared. At every
compared step the chosen token's logprob and the top-``TOP_LOGPROBS`` tokens' logprobs (those both
runs return) must agree within ``logprob_atol``.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.testing.model_parity import TENSOR_PARALLEL_2, TOP_LOGPROBS, mixed_prompts


@dataclass
class TensorParallelReport:
    num_prompts: int
    num_tokens_compared: int = 0
    max_logprob_error: float = 0.0
    near_ties: list[str] = field(default_factory=list)


def _serve(model_path: Path, prompts: list[list[int]], new_tokens: int, llm_kwargs: dict[str, Any]) -> list[Any]:
    from pagoda import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    kwargs: dict[str, Any] = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=max(128, longest),
                                  block_size=16, num_kv_blocks=(len(prompts) + 2) * (longest // 16 + 2))
    kwargs.update(llm_kwargs)
    llm = LLM(model=str(model_path), **kwargs)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def check_tensor_parallel_matches_single_rank(
    model_path: Path, vocab_size: int, *, new_tokens: int = 8, seed: int = 0, logprob_atol: float = 1e-3,
    tie_gap: float = 1e-3, llm_kwargs: dict[str, Any] | None = None,
) -> TensorParallelReport:
    """Serve ``model_path`` at one rank and at two; raises AssertionError naming each disagreement."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    prompts = mixed_prompts(vocab_size, num_prompts=8, max_len=40, seed=seed)
    single = _serve(model_path, prompts, new_tokens, dict(llm_kwargs or {}))
    split = _serve(model_path, prompts, new_tokens, {**(llm_kwargs or {}), **TENSOR_PARALLEL_2})
    report = TensorParallelReport(num_prompts=len(prompts))
    failures: list[str] = []
    for index, (one, two) in enumerate(zip(single, split, strict=True)):
        if len(one.token_ids) != new_tokens or len(two.token_ids) != new_tokens:
            failures.append(f"prompt {index}: {len(one.token_ids)} / {len(two.token_ids)} tokens, {new_tokens} asked")
            continue
        for step, (a, b) in enumerate(zip(one.token_ids, two.token_ids, strict=True)):
            ref: dict[int, Any] = one.logprobs[step]
            got: dict[int, Any] = two.logprobs[step]
            if a != b:
                top = sorted((lp.logprob for lp in ref.values()), reverse=True)
                gap = top[0] - top[1] if len(top) > 1 else float("inf")
                if gap < tie_gap:
                    report.near_ties.append(f"prompt {index} step {step}: {a} vs {b} (gap {gap:.2e})")
                else:
                    failures.append(f"prompt {index} step {step}: token {b} at 2 ranks, {a} at 1 (gap {gap:.3f})")
                break
            report.num_tokens_compared += 1
            for token in set(ref) & set(got):
                error = abs(ref[token].logprob - got[token].logprob)
                report.max_logprob_error = max(report.max_logprob_error, error)
                if error > logprob_atol:
                    failures.append(f"prompt {index} step {step} token {token}: logprob {got[token].logprob:.5f} "
                                    f"at 2 ranks, {ref[token].logprob:.5f} at 1")
    if failures:
        raise AssertionError(f"{len(failures)} disagreements ({report}):\n" + "\n".join(failures[:20]))
    return report
