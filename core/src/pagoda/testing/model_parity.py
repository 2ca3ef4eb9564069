"""A model family's end-to-end parity check against transformers, for pagoda's plugins and third parties.

``check_parity`` saves a seeded tiny transformers model as a safetensors
checkpoint, serves it through ``pagoda.LLM`` (float32, chunked prefill with a
small token budget, prefix caching on, a mixed batch of prompts of different
lengths, some sharing a long prefix) and compares, prompt by prompt, greedy
tokens with transformers' own greedy ``generate`` and the top-5 logprobs of
every generated step with transformers' log-softmax at the same position.

A differing token is accepted only where transformers' own two best logits are
closer than ``TIE_GAP`` (float rounding then decides, and neither side is
wrong); the comparison of that prompt stops there. Everything else fails.

Typical use in a plugin's tests::

    from pagoda.testing.model_parity import build_tiny_model, check_parity

    def test_parity(tmp_path):
        hf_model = build_tiny_model(transformers.GPT2Config(...), seed=0)
        check_parity(hf_model, tmp_path)

``check_tensor_parallel_parity`` is the same check at ``tensor_parallel_size=2`` (mp executor).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Below this gap between transformers' two best logits, float rounding may pick either token.
TIE_GAP = 1e-4
LOGPROB_ATOL = 1e-3
TOP_LOGPROBS = 5


def randomize_weights(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Seeded weights large enough that logits are far from ties (transformers' 0.02 init gives near-ties).

    Matrices get unit-variance rows (``randn / sqrt(fan_in)``, times ``scale``), norm weights
    ``1 + 0.3 * randn`` (so a misplaced norm shows), other vectors (biases) ``0.3 * randn``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1 and ("norm" in name or name.endswith("ln_f.weight") or ".ln_" in name):
                if name.endswith(".weight"):
                    param.copy_(1.0 + 0.3 * noise)
                else:
                    param.copy_(0.3 * noise)
            elif param.ndim >= 2:
                # transformers 5 stacks MoE experts as [num_experts, out, in]: each slice is one matrix
                stacked_matrices = param.ndim == 3 and "experts" in name
                fan_in = param.shape[-1] if param.ndim == 2 or stacked_matrices else math.prod(param.shape[1:])
                param.copy_(scale * noise / fan_in**0.5)
            else:
                param.copy_(0.3 * noise)


def build_tiny_model(hf_config: Any, seed: int = 0, model_cls: Any = None, scale: float = 1.0) -> Any:
    """A transformers causal LM from ``hf_config`` (eager attention, float32, eval) with ``randomize_weights``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_cls is None:
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    else:
        hf_config._attn_implementation = "eager"
        model = model_cls(hf_config)
    model = model.float().eval()
    randomize_weights(model, seed=seed, scale=scale)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def save_tiny_model(hf_model: Any, path: Path) -> Path:
    """config.json + model.safetensors (what ``pagoda.LLM`` loads) under ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(path, safe_serialization=True)
    return path


def mixed_prompts(vocab_size: int, num_prompts: int = 10, max_len: int = 120, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` prompts of 1 token, ``max_len`` tokens and lengths between, then 3 more sharing
    a long prefix with the second (``check_parity`` sends those after the rest, so they hit the
    prefix cache). Lengths above the step budget make prefill chunk.
    """
    if num_prompts < 8:
        raise ValueError("the parity bar is a mixed batch of at least 8 prompts")
    rng = random.Random(seed)
    lengths = [1, max_len] + [rng.randint(2, max_len) for _ in range(num_prompts - 2)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    shared = prompts[1][: max(2, (max_len * 3) // 4)]
    prompts += [shared + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(3)]
    return prompts


@dataclass
class ParityReport:
    """What ``check_parity`` compared: accepted near-ties are listed, not hidden."""

    num_prompts: int
    num_tokens_compared: int
    max_logprob_error: float
    near_ties: list[tuple[int, int, float]] = field(default_factory=list)  # (prompt, step, transformers' gap)
    num_cached_tokens: int = 0


def _hf_greedy(hf_model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _hf_logprobs(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 log-softmax of transformers' logits over one unpadded sequence."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_parity(
    hf_model: Any,
    tmp_path: Path,
    *,
    prompts: list[list[int]] | None = None,
    new_tokens: int = 8,
    max_num_batched_tokens: int = 32,
    block_size: int = 16,
    llm_kwargs: dict[str, Any] | None = None,
    logprob_atol: float = LOGPROB_ATOL,
    shared_prefix_last: bool = True,
    model_path: Path | None = None,
    tie_gap: float = TIE_GAP,
) -> ParityReport:
    """Serve ``hf_model``'s weights through ``pagoda.LLM`` and compare with transformers; raises AssertionError.

    With the default prompts (``mixed_prompts``) the last three share a prefix with an earlier one and
    are sent after the rest (``shared_prefix_last``); the check then asserts that they hit the prefix cache.
    ``llm_kwargs`` reach ``LLM`` (e.g. ``attention_backend``, ``model_impl``) over the defaults here:
    float32, chunked prefill under ``max_num_batched_tokens``, prefix caching on.
    ``model_path`` serves that checkpoint instead of saving ``hf_model`` (e.g. a GGUF file holding its
    weights: ``pagoda.testing.gguf_writer``); ``hf_model`` stays the reference.
    ``tie_gap`` widens the near-tie bound where the served model rounds on purpose (int8 activations:
    a float difference in the last bit can move an element a whole int8 step).
    """
    from pagoda import LLM, SamplingParams

    config = hf_model.config
    vocab_size = int(config.vocab_size)
    if prompts is None:
        prompts = mixed_prompts(vocab_size, seed=0)
    elif shared_prefix_last and len(prompts) < 11:
        raise ValueError("with shared_prefix_last the last 3 prompts are sent separately: pass 11 or more")
    longest = max(len(p) for p in prompts) + new_tokens
    model_dir = model_path if model_path is not None else save_tiny_model(hf_model, tmp_path / "parity-model")
    kwargs: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max(256, longest),
        enable_chunked_prefill=True,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=True,
        block_size=block_size,
        num_kv_blocks=(len(prompts) + 2) * (longest // block_size + 2),
    )
    kwargs.update(llm_kwargs or {})
    llm = LLM(model=str(model_dir), **kwargs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    # The mixed batch first, then the prompts that share its long prompt's prefix: by then that
    # prefix's blocks are full and hashed, so they must come from the prefix cache.
    first, later = (prompts[:-3], prompts[-3:]) if shared_prefix_last else (prompts, [])
    outputs = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    later_outputs = llm.generate([{"prompt_token_ids": p} for p in later], params, use_tqdm=False) if later else []
    outputs = list(outputs) + list(later_outputs)

    report = ParityReport(num_prompts=len(prompts), num_tokens_compared=0, max_logprob_error=0.0)
    failures: list[str] = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        completion = output.outputs[0]
        report.num_cached_tokens += int(output.num_cached_tokens or 0)
        ours = list(completion.token_ids)
        expected = _hf_greedy(hf_model, prompt, new_tokens)
        if len(ours) != new_tokens:
            failures.append(f"prompt {index} (len {len(prompt)}): {len(ours)} tokens generated, {new_tokens} asked")
            continue
        reference = _hf_logprobs(hf_model, prompt + expected)[len(prompt) - 1 :]
        for step, (a, b) in enumerate(zip(ours, expected)):
            ref_step = reference[step]
            if a != b:
                top2 = torch.topk(ref_step, 2).values
                gap = float(top2[0] - top2[1])
                if gap < tie_gap:
                    report.near_ties.append((index, step, gap))
                    break
                failures.append(
                    f"prompt {index} (len {len(prompt)}) step {step}: pagoda {ours} vs transformers {expected} "
                    f"(transformers' top-2 gap {gap:.2e} is no tie)"
                )
                break
            step_logprobs = completion.logprobs[step] if completion.logprobs is not None else None
            if not step_logprobs:
                failures.append(f"prompt {index} step {step}: no logprobs returned")
                break
            ref_top = torch.topk(ref_step, TOP_LOGPROBS)
            for token_id, ref_value in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
                entry = step_logprobs.get(int(token_id))
                if entry is None:
                    # a near-tie at the 5th place may swap which token is listed
                    fifth_gap = float(ref_top.values[-2] - ref_top.values[-1]) if TOP_LOGPROBS > 1 else 0.0
                    if token_id == ref_top.indices[-1] and fifth_gap < logprob_atol:
                        continue
                    failures.append(f"prompt {index} step {step}: token {token_id} missing from pagoda's top logprobs")
                    continue
                error = abs(float(entry.logprob) - ref_value)
                report.max_logprob_error = max(report.max_logprob_error, error)
                if error > logprob_atol:
                    failures.append(
                        f"prompt {index} step {step}: logprob of {token_id} {entry.logprob:.6f} vs {ref_value:.6f}"
                    )
            report.num_tokens_compared += 1
    assert not failures, f"{len(failures)} parity failures:\n" + "\n".join(failures[:10])
    if shared_prefix_last and kwargs["enable_prefix_caching"]:
        later_cached = sum(int(o.num_cached_tokens or 0) for o in later_outputs)
        assert later_cached > 0, "the shared-prefix prompts did not hit the prefix cache"
    assert report.num_tokens_compared >= len(prompts) * new_tokens // 2, f"too few tokens compared: {report}"
    return report


# two tensor-parallel ranks in worker processes (mp executor, gloo on loopback)
TENSOR_PARALLEL_2: dict[str, Any] = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def check_tensor_parallel_parity(hf_model: Any, tmp_path: Path, *, seed: int = 0, new_tokens: int = 6,
                                 llm_kwargs: dict[str, Any] | None = None) -> ParityReport:
    """``check_parity`` at ``tensor_parallel_size=2``: a family's tensor-parallel scenario.

    Kept small, as two worker processes start per call: 8 mixed prompts of up to 40 tokens and 3 that
    share a prefix, ``new_tokens`` greedy tokens each. Give the model heads, KV heads and widths that
    two ranks divide (fewer KV heads than ranks replicates them) and an odd vocabulary, so the padded
    vocab-parallel split is exercised too.
    """
    vocab_size = int(hf_model.config.vocab_size)
    return check_parity(hf_model, tmp_path, prompts=mixed_prompts(vocab_size, num_prompts=8, max_len=40, seed=seed),
                        new_tokens=new_tokens, llm_kwargs={**TENSOR_PARALLEL_2, **(llm_kwargs or {})})
